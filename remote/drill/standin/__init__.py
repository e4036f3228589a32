"""The rehearsal server: a small real model behind SGLang's HTTP endpoints, for the drill and tests.

    python -m remote.drill.standin --model DIR --port N [--host 127.0.0.1] [--load-delay S]
        [--warmup-delay S | --skip-server-warmup] [--device cpu|cuda] [--dtype float32|bfloat16] [--api-key KEY]
        [--preferred-sampling-params JSON] [--max-queued-requests N] [--served-name NAME] [--metrics]
        [--gpu-file F --gpu-mib M [--release-after S | --hold-until-killed] [--stubborn-holder]]
        [--flap-health] [--speculative-drafter DRAFTER_DIR] [--step-delay S]
        [--enable-memory-saver [--enable-weights-cpu-backup] [--kv-cache-mib M] [--cuda-graph-mib M]
         [--release-frees-after S]]
        [--admin-api-key KEY] [--sglang-version X.Y.Z] [--weights-come-back-wrong DELTA]

It serves the tiny target (`remote.drill.tinymodel`) with transformers, and behaves as SGLang 0.5.23
does where the console and the workers meet it (each fact and its SGLang source: docs/sglang.md):
- start-up: the port stays closed while the weights load (SGLang starts uvicorn only once its
  scheduler has them), logging SGLang's lines ("Load weight begin", shard progress, "Load weight end.
  elapsed=..."); then it listens while "Starting": /health and /ready answer 503, the rest serves;
  after `--warmup-delay` it sends itself SGLang's warm-up (/model_info, then an 8-token /generate),
  turns "Up" and logs "The server is fired up and ready to roll!";
  GET  /health, /health_generate   503 until Up; then 200 once a one-token generation has answered
                                   (within SGLANG_HEALTH_CHECK_TIMEOUT, 20 s), else 503
  GET  /ready                      200 when Up, else 503
  GET  /model_info (/get_model_info), /server_info (/get_server_info), /v1/models
  POST /generate (PUT too)         SGLang's JSON contract: `text` or `input_ids` (one, or a batch: a list
                                   answered by a list), `sampling_params` (unknown keys: 400), `rid`;
                                   `text`, `output_ids` (the stop token kept), `meta_info` (id,
                                   finish_reason object, prompt/completion/cached tokens, e2e_latency...);
                                   `stream`: SSE, a chunk per token, data: [DONE]
  POST /v1/completions             OpenAI-style (temperature 1.0 unless given, as SGLang), return_token_ids
  POST /v1/chat/completions        OpenAI chat: the model's chat template, usage, finish reasons, stream
                                   (SSE chunks, data: [DONE]) (`remote.drill.chat`)
  POST /abort_request              {"rid": ...} or {"abort_all": true}: an abort finish, 200
  POST /pause_generation           {"mode": abort (default) | retract | in_place}; /continue_generation
                                   (`--sglang-version` before 0.5.6: no body read, every request aborted,
                                   as SGLang 0.5.5; /server_info's version says which)
  POST /release_memory_occupation  {"tags": kv_cache, weights, cuda_graph; none: all}; /resume_memory_occupation
                                   (GET too): SGLang's memory saver, `remote.drill.memory_saver`: each
                                   mode's effect on requests in flight, the idle assertion and the
                                   repeated calls that end SGLang's server, the memory leaving the
                                   simulated GPU (torch_memory_saver's real release on --device cuda)
  GET  /flush_cache                (POST too) [?timeout=S]: the prefix cache emptied when idle (200 "Cache
                                   flushed."), else 400 (SGLang 0.5.23's flush; the released tags play no part)
  GET  /weights_checker            (POST too) {"action": checksum (default) | snapshot | compare |
                                   reset_tensors, "selector", "skip_tensor_list"}: SGLang 0.5.23's checker
                                   over the model's real weights (`remote.drill.weights_checker`); 0.5.6's
                                   (no checksum) or none (404) as `--sglang-version` says
  GET  /metrics                    with --metrics: SGLang's gauges and counters, its label set
  GET  /v1/loads                   the scheduler's load snapshot (running, waiting, queues), taken now
- `--api-key KEY`: every route but /health*, /ready* and /metrics* answers 401 without
  `Authorization: Bearer KEY` (the four memory saver routes want `--admin-api-key` instead when set); `--preferred-sampling-params` is laid under each request's as SGLang
  does; `--max-queued-requests N` aborts with 503 "The request queue is full." past N waiting.
- served as SGLang serves (FastAPI on uvicorn): a client that disconnects aborts its request (polled
  every SGLANG_REQUEST_STATE_WAIT_TIMEOUT, 4 s; a cut stream 2 s after), connections kept alive;
- errors in SGLang's shapes: a contract violation `{"error": "..."}`, a bad value `{"error":
  {"message": ...}}`, an unparsable body or an abort's HTTP error `{"object": "error", "message", ...}`,
  an unknown route `{"detail": "Not Found"}` (`remote.drill.sglang_contract`).

Generation is one function, `generate_tokens` (prefill, then one token per step through the KV
cache, SGLang's logit processing and finish checks), so a speculative drafter can take its place.
With `--speculative-drafter` a DFlash checkpoint drafts for it (`remote.drill.specdecode`, real
DFLASH speculative decoding: the drafter proposes a block from the target's layers, the target
verifies greedily): greedy requests without logit processing or stop strings are decoded so and
their meta_info carries SGLang's spec_verify_ct, spec_accept_length, spec_correct_drafts_histogram...;
/server_info reports speculative_algorithm "DFLASH", the draft model path and the block size.

`--device cuda` loads and serves the model on the GPU (default cpu). `--step-delay S` adds S seconds to
every decode step, a slower model, so that tests and drills can catch requests in flight.

Simulated GPU memory (`--gpu-file`, see `remote.drill.simgpu`): a child "GPU worker" holds `--gpu-mib`
on every simulated GPU while the server runs and lets it go after the server ends, or not
(`--release-after`, `--hold-until-killed`, `--stuck-marker F`: removing F re-arms the episode on a
running server, the drill's `rearm`; `--stubborn-holder`): `gpu_worker` tells how. `--flap-health` is
a fault, not SGLang: the port opens before the weights load, /health alternates 200/503 and /generate
answers 503 until loaded, then it is up without a warm-up (a server whose health endpoint answers
before it can generate). `--nan-after N` is another fault: from the N+1-th generated token on the
logits are NaN (a broken kernel), which ends the request as SGLang ends it, EOS in place of the bad
token and finish `stop` "NaN happened". `--weights-come-back-wrong DELTA` is a third: a `weights`
release brings the target's lm_head back with DELTA added (the same greedy tokens, another checksum).

Its parts, one module each:
- `__main__`    start-up and shutdown: parse the flags, bind, load, listen, warm up, serve until SIGTERM;
- `arguments`   the command line;
- `server`      the model worker: start-up, SGLang's scheduler state and counters, health, the info
                and metrics bodies, requests run one at a time; the only door the front uses;
- `model`       the tiny target with its tokenizer, and generation (`generate_tokens`, `generate`);
- `http_front`  the HTTP front as SGLang serves it: FastAPI on uvicorn, the API keys, SIGTERM;
- `routes`      SGLang's routes and methods, each asking the model worker in a worker thread;
- `http_io`     a client's disconnect turned into its request's abort, Server-Sent Events, error answers;
- `generate_body` /generate's and /v1/completions' bodies checked in SGLang's two stages, and answered;
- `gpu_worker`  the child that holds the simulated GPU memory.
"""
