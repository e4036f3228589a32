"""The rehearsal server's `/weights_checker`: SGLang 0.5.23's weights checker over the tiny model's real
weights (and 0.5.6's, and none before it), as `--sglang-version` says.

What it follows (docs/sglang.md, "The weights checker"):
- 0.5.23 (`entrypoints/http_server.py`, `check_weights`: GET or POST, ADMIN_OPTIONAL, the body optional;
  `managers/io_struct.py`, `CheckWeightsReqInput`: `action` "checksum" by default, "snapshot",
  "reset_tensors" or "compare", `allow_quant_error`, `skip_tensor_list`, `selector` "target" | "draft" |
  "all" (the default); `managers/scheduler_components/weight_updater.py`, `WeightUpdater.check_weights`
  and `_merge_checksum_payloads`; `utils/weight_checker.py`, `WeightChecker.handle`, `overall_checksum`;
  `managers/tokenizer_control_mixin.py`, `check_weights`): the answer is `{"success", "message"}` and,
  for a checksum, `ranks` (one per TP rank: `checksums` {tensor name: 16 hex digits}, `per_gpu_checksum`
  = `overall_checksum` (sha256 over the sorted names, each followed by its checksum), `parallelism_info`
  one per role) and `per_engine_checksum` (sha256 over the ranks' `per_gpu_checksum`). 200 when it
  succeeded, else 400 with `success` false and the exception's text as `message` ("Unsupported
  action='x'"; a compare without a snapshot is a bare assert: ""; a compare that differs: "check tensor
  equality failed:" and a line per tensor).
- Parameters, then buffers; non-persistent buffers (names holding cos_sin_cache, cos_cache, sin_cache,
  inv_freq, freqs_cis, expert_mask_gpu) and names holding a `skip_tensor_list` entry are left out. The
  drafter's tensors (a DFLASH speculator's, role "draft") are named `draft.<name>`; the target's keep their
  names.
- A tensor's checksum is SGLang's `tensor_hash` on the CPU (`managers/mm_utils.py`): the first 8 bytes of
  the sha256 of its bytes, as 16 hex digits. (On a GPU SGLang hashes with a Triton kernel, another value
  for the same weights; only equality means anything, and this server always hashes on the CPU.)
- While the weights are released, SGLang's checksum reads memory torch_memory_saver has unmapped (nothing
  in `check_weights` guards it): here, as for a forward pass over released memory, the server ends (the
  rehearsal server's reading, not measured on a GPU).
- 0.5.6 (`http_server.py`, `check_weights`: POST only, no auth level; `io_struct.py`, `CheckWeightsReqInput`:
  `action` required; `utils/weight_checker.py`: snapshot, reset_tensors and compare, no checksum): a
  checksum is 400 `{"success": false, "message": "Unsupported action='checksum'"}`; answers carry only
  `success` and `message`. The releases between 0.5.6 and 0.5.23 were not read: answered as 0.5.6.
- 0.5.5 and earlier: no such route (404 `{"detail": "Not Found"}`).

`--weights-come-back-wrong DELTA` is a fault, not SGLang: a `weights` release brings the target's
`lm_head` back with DELTA added to every element. Every logit moves by the same amount, so the greedy
tokens stay the same while the checksum does not: a server whose weights came back wrong and whose
outputs do not show it (`memory_saver.come_back_wrong`, at the resume).
"""

from __future__ import annotations

import hashlib
from typing import Any

from remote.drill.memory_saver import Refused, release_of

ACTIONS = ("snapshot", "reset_tensors", "compare", "checksum")  # weight_checker.py, WeightChecker.handle
SELECTORS = ("target", "draft", "all")  # weight_updater.py, _parse_runner_selector
NON_PERSISTENT = ("cos_sin_cache", "cos_cache", "sin_cache", "inv_freq", "freqs_cis", "expert_mask_gpu")
CHECKER_SINCE = (0, 5, 6)  # the first release read with /weights_checker (0.5.5 has none)
CHECKSUM_SINCE = (0, 5, 23)  # the first release read whose checker takes "checksum" (0.5.6's does not)
ROUTE = "/weights_checker"


def add_arguments(parser: Any) -> None:
    parser.add_argument("--weights-come-back-wrong", type=float, metavar="DELTA",
                        help="a fault, not SGLang: a `weights` release brings the target's lm_head back with DELTA "
                             "added to every element (the same greedy tokens, another /weights_checker checksum)")


def kind_of(version: str) -> str | None:
    """Which checker a release has: "0.5.23", "0.5.6" or None (no route)."""
    release = release_of(version)
    if release is None or release >= CHECKSUM_SINCE:
        return "0.5.23"
    return "0.5.6" if release >= CHECKER_SINCE else None


def tensor_hash(tensor: Any) -> str:
    """SGLang's tensor_hash on the CPU, as `_hash_tensor` writes it: 16 hex digits."""
    import torch

    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return f"{int.from_bytes(hashlib.sha256(memoryview(data)).digest()[:8], 'big'):016x}"


def overall_checksum(checksums: dict[str, str]) -> str:
    """weight_checker.py, overall_checksum."""
    digest = hashlib.sha256()
    for name in sorted(checksums):
        digest.update(name.encode())
        digest.update(checksums[name].encode())
    return digest.hexdigest()


def _skipped(name: str, skip: list[str] | None) -> bool:
    return any(p in name for p in NON_PERSISTENT) or any(p in name for p in (skip or ()))


def _placement(role: str) -> dict[str, Any]:
    return {"role": role, "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0, "pp_size": 1,
            "rank": 0, "size": 1}


class WeightsChecker:
    """One server's checker: its snapshot (per role) between a snapshot and a compare.

    `server` is the standin's Server: its `model` (the target, and its `speculator`), its memory saver
    (what is released) and `die(reason)`."""

    def __init__(self, server: Any, version: str):
        self.server = server
        self.kind = kind_of(version)
        self.snapshots: dict[str, dict[str, Any]] = {}

    def admin_optional(self) -> bool:
        """0.5.23's route is ADMIN_OPTIONAL; 0.5.6's has no auth level (the API key)."""
        return self.kind == "0.5.23"

    def methods(self) -> tuple[str, ...]:
        return ("GET", "POST") if self.kind == "0.5.23" else ("POST",) if self.kind else ()

    def _roles(self, selector: str) -> list[tuple[str, dict[str, Any]]]:
        """(role, {name: tensor}) for each runner the selector takes (weight_updater.py, _select_runners)."""
        model = self.server.model
        if model is None:
            return []
        roles = {"all": ("target", "draft")}.get(selector, (selector,))
        runners = []
        if "target" in roles:
            runners.append(("target", {**dict(model.model.named_parameters()), **dict(model.model.named_buffers())}))
        speculator = getattr(model, "speculator", None)
        if "draft" in roles and speculator is not None:
            runners.append(("draft", dict(speculator.drafter.w)))
        return runners

    def answer(self, body: dict) -> tuple[int, dict]:
        """The route's (status, body) for a body already parsed as a JSON object (or {} for none)."""
        if self.kind == "0.5.6" and "action" not in body:
            raise Refused(400, "action: Field required")
        action = body.get("action", "checksum")
        if not isinstance(action, str):
            raise Refused(400, f"action: Input should be a valid string, got {action!r}")
        try:
            if self.kind == "0.5.6" and action == "checksum":
                raise ValueError(f"Unsupported action={action!r}")
            payload = self._handle(action, body)
        except Exception as exc:  # noqa: BLE001 - weight_updater.check_weights: any failure is success false
            return 400, {"success": False, "message": str(exc)}
        answer: dict[str, Any] = {"success": True, "message": "Success."}
        if payload is not None:  # tokenizer_control_mixin.check_weights: ranks and the engine's checksum
            answer["ranks"] = [payload]
            answer["per_engine_checksum"] = hashlib.sha256(payload["per_gpu_checksum"].encode()).hexdigest()
        return 200, answer

    def _handle(self, action: str, body: dict) -> dict | None:
        selector = body.get("selector", "all")
        if selector not in SELECTORS:
            raise ValueError(f"invalid selector {selector!r}; expected 'target', 'draft', or 'all'")
        if action not in ACTIONS:
            raise ValueError(f"Unsupported action={action!r}")
        skip = body.get("skip_tensor_list")
        saver = self.server.saver
        if saver.enabled and "weights" in saver.released:
            self.server.die("RuntimeError: CUDA error: an illegal memory access was encountered (/weights_checker "
                            "read the weights while they are released: the rehearsal server's reading of "
                            "torch_memory_saver, whose release unmaps that memory)")
        import torch

        checksums: dict[str, str] = {}
        roles = []
        with torch.inference_mode():
            for role, tensors in self._roles(selector):
                if action == "snapshot":
                    self.snapshots[role] = {n: t.detach().cpu().clone() for n, t in tensors.items()}
                elif action == "reset_tensors":
                    for name, tensor in tensors.items():
                        if not _skipped(name, skip) and tensor.is_floating_point():
                            tensor.copy_(torch.rand(tensor.shape, dtype=torch.float32).to(tensor.dtype))
                elif action == "compare":
                    self._compare(role, tensors, skip)
                else:
                    for name, tensor in tensors.items():
                        if not _skipped(name, skip):
                            checksums[name if role == "target" else f"{role}.{name}"] = tensor_hash(tensor)
                    roles.append(_placement(role))
        if action != "checksum" or not roles:
            return None
        return {"checksums": checksums, "per_gpu_checksum": overall_checksum(checksums), "parallelism_info": roles}

    def _compare(self, role: str, tensors: dict[str, Any], skip: list[str] | None) -> None:
        snapshot = self.snapshots.get(role)
        assert snapshot is not None  # noqa: S101 - SGLang's own bare assert: its message is ""
        errors = []
        for name, tensor in tensors.items():
            if _skipped(name, skip):
                continue
            expect, actual = snapshot[name].float(), tensor.detach().cpu().float()
            if not bool((expect == actual).all()):
                diff = (expect - actual).abs()
                errors.append(f"name={name} max_abs_err={float(diff.max())} mean_abs_err={float(diff.mean())}")
        self.snapshots.pop(role, None)
        if errors:
            raise ValueError("check tensor equality failed:\n" + "\n".join(errors))
