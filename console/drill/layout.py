"""Where everything of one drill lives, under its directory (default: the user state dir's `drill`).

    <dir>/dflash-ops.toml        the config the drill writes (its path is what `drill up` prints)
    <dir>/drill.pid              the rehearsal hosts' process, while it runs
    <dir>/drill.json             its state: ports, pids, service, assets (written atomically)
    <dir>/hosts.log              its log
    <dir>/prompts.jsonl          the drill's prompt set
    <dir>/<host>/ssh/            host key, client key, known_hosts, an empty ssh_config
    <dir>/<host>/home/           the host's home (commands run there, SFTP starts there)
    <dir>/<host>/home/dflash-ops the host's workdir (simulated-gpu.json in it: the simulated GPUs)
    <dir>/ct129/home/standin/    the service's pid file, log and stuck-VRAM marker
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import platformdirs

DIR_ENV = "DFLASH_OPS_DRILL_DIR"
INFERENCE_HOST = "ct129"
TRAINING_HOST = "ct200"
HOSTS = (INFERENCE_HOST, TRAINING_HOST)
GPUS_PER_REPLICA = 2  # the story's inference host had 2 GPUs; each of a fleet's replicas gets its own pair
SIMULATED_GPU_FILE = "simulated-gpu.json"  # in the workdir of a host configured with `simulated_gpus`
TINY_TARGET_NAME = "tiny-qwen3.5-hybrid"
GPU_TARGET_NAME = "qwen3.5-hybrid-1.7b-random"


def default_dir() -> Path:
    """$DFLASH_OPS_DRILL_DIR, else `drill` under the user state dir."""
    override = os.environ.get(DIR_ENV)
    return Path(override) if override else Path(platformdirs.user_state_dir("dflash-ops")) / "drill"


@dataclass(frozen=True)
class DrillLayout:
    """The paths of one drill directory. `gpu`: a drill on this machine's CUDA GPU, whose target is
    the few-GB one (`remote.drill.tinymodel.build_gpu_target`). `memory_saver`: the rehearsal server
    runs with SGLang's memory saver and a CPU backup of its weights (the pause route's case).
    `crowded` (with `gpu`): the card left with too little room for the extraction beside the server's
    weights, so the pause route must release them too (`remote.drill.service start --cuda-leave-mib`)."""

    dir: Path
    gpu: bool = False
    memory_saver: bool = True
    replicas: int = 1  # rehearsal servers on ct129; more than one: behind SGLang's real router (a fleet)
    router: str = "smg"  # which router a fleet runs: "smg" or "sglang-router" (console/drill/fleet.py)
    crowded: bool = False

    @classmethod
    def at(cls, path: str | os.PathLike | None = None, gpu: bool = False, memory_saver: bool = True,
           replicas: int = 1, router: str = "smg", crowded: bool = False) -> DrillLayout:
        return cls(Path(path).expanduser().resolve() if path is not None else default_dir().resolve(), gpu,
                   memory_saver, replicas, router, crowded)

    @property
    def model_name(self) -> str:
        return GPU_TARGET_NAME if self.gpu else TINY_TARGET_NAME

    @property
    def config(self) -> Path:
        return self.dir / "dflash-ops.toml"

    @property
    def pid_file(self) -> Path:
        return self.dir / "drill.pid"

    @property
    def state_file(self) -> Path:
        return self.dir / "drill.json"

    @property
    def log(self) -> Path:
        return self.dir / "hosts.log"

    @property
    def prompts(self) -> Path:
        return self.dir / "prompts.jsonl"

    def ssh_dir(self, host: str) -> Path:
        return self.dir / host / "ssh"

    def home(self, host: str) -> Path:
        return self.dir / host / "home"

    def workdir(self, host: str) -> Path:
        return self.home(host) / "dflash-ops"

    def lock_dir(self, host: str) -> Path:
        """The host lock's directory: each rehearsal host its own, as two machines would have (the
        default /var/tmp is this one machine's, shared by every drill and test on it)."""
        return self.dir / host / "locks"

    def simulated_gpus(self, host: str) -> Path:
        return self.workdir(host) / SIMULATED_GPU_FILE

    @property
    def service_state(self) -> Path:
        return self.home(INFERENCE_HOST) / "standin"

    def replica_state(self, index: int) -> Path:
        """Replica `index`'s service directory (0 is the one-server drill's service)."""
        return self.service_state if index == 0 else self.home(INFERENCE_HOST) / f"standin-r{index + 1}"

    def replica_gpu_indices(self, index: int) -> list[int]:
        """Replica `index`'s GPUs of ct129's simulated file: the replicas share the host, as a fleet's
        replicas on one node do, each on its own GPUs, so ct129's telemetry shows every replica's memory
        and a window on one replica watches (and ends holders on) its GPUs only."""
        return list(range(index * GPUS_PER_REPLICA, (index + 1) * GPUS_PER_REPLICA))

    @property
    def router_log(self) -> Path:
        return self.dir / "router.log"

    @property
    def target(self) -> Path:
        return self.home(INFERENCE_HOST) / "models" / self.model_name

    @property
    def target_copy(self) -> Path:
        """The training host's copy of the target (its free GPU can extract without downtime)."""
        return self.home(TRAINING_HOST) / "models" / self.model_name

    @property
    def reference(self) -> Path:
        return self.home(TRAINING_HOST) / "dflash" / "reference" / "z-lab-tiny-DFlash"

    @property
    def candidate(self) -> Path:
        return self.home(TRAINING_HOST) / "dflash" / "checkpoints" / "v4" / "step-5400"

    @property
    def training_log(self) -> Path:
        return self.home(TRAINING_HOST) / "train.log"


def describe(state: dict[str, Any]) -> str:
    """A drill's settings (its state's, or those asked for) in words: "2 replicas behind smg, SIMULATED
    GPUs". A state without a router is an old drill's: sglang-router."""
    replicas = state.get("replicas", 1)
    fleet_words = (f"{replicas} replicas behind {state.get('router') or 'sglang-router'}" if replicas > 1
                   else "one server")
    return (f"{fleet_words}, {'REAL GPU' if state.get('gpu') else 'SIMULATED GPUs'}"
            f"{', crowded' if state.get('crowded') else ''}"
            f"{'' if state.get('memory_saver', True) else ', no memory saver'}")
