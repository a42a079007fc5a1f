"""A real SGLang server on CPU with HiCache on, for the real-server test, the demo and the
cost benchmark: ``python -m sglang.launch_server`` as a user starts it, otel-hicache's plugin
loaded by SGLang itself in each scheduler process, configured only by ``OTEL_*``.

On CPU it needs a tiny local model (``make_model``: random weights, a tokenizer trained
here, no hub) and the stand-ins in ``cpu/`` (put first on the server's PYTHONPATH).
"""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import check_pipeline as cp  # (e2e/ is on the path of every caller) the Jaeger API's span helpers

HERE = Path(__file__).resolve().parent
CPU_SUPPORT = HERE / "cpu"
START_TIMEOUT_S = 420.0  # a cold start on 2 busy cores, tensor parallelism 2 included
TELEMETRY_PROCESS = "otel_hicache.sinks.process"  # its command line in the process table
# SGLang's own counters of what HiCache moved, by direction (its /metrics)
SGLANG_COUNTERS = {
    "offload": ("sglang:hicache_backup_tokens_total", "sglang:hicache_backup_bytes_total"),
    "onboard": ("sglang:load_back_tokens_total", "sglang:load_back_bytes_total"),
}


def make_model(out: Path) -> Path:
    """A random-weight Llama (hidden 64, 2 layers, 2 KV heads, bf16) and a byte-level BPE
    tokenizer trained on the standard library's sources; reused when already there."""
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    out.mkdir(parents=True, exist_ok=True)
    sources = sorted(str(p) for p in Path(os.__file__).parent.glob("*.py"))[:60]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(sources, trainers.BpeTrainer(vocab_size=2048, special_tokens=["<s>", "</s>", "<pad>"],
                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                           show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(out)
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=len(fast), max_position_embeddings=4096,
                      bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                      pad_token_id=fast.pad_token_id, torch_dtype="bfloat16", tie_word_embeddings=False)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def descendants(root: int) -> dict[int, int]:
    """``{pid: parent pid}`` of every process under ``root``."""
    parents = {int(p.name): _ppid(int(p.name)) for p in Path("/proc").iterdir() if p.name.isdigit()}
    found: dict[int, int] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in found:
                found[pid] = parent
                frontier.append(pid)
    return found


class Server:
    """One ``sglang.launch_server`` on CPU; ``with Server(...) as s:`` starts it, waits until it
    answers, and at the end stops its whole process tree and checks that nothing is left."""

    def __init__(self, model: Path, log: Path, *, policy: str = "write_through", page_size: int = 1,
                 tp: int = 1, trace: bool = False, plugin: bool = True, service: str = "sglang-cpu",
                 otlp_endpoint: str = "http://127.0.0.1:4317", max_total_tokens: int = 1024,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.tp = tp
        self.page_size = page_size
        self.proc: subprocess.Popen | None = None
        self.seen: set[int] = set()  # every process of the tree seen while it ran
        self.args = [
            sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
            "--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
            "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(self.port), "--tp", str(tp),
            "--max-total-tokens", str(max_total_tokens), "--page-size", str(page_size),
            "--max-running-requests", "4", "--chunked-prefill-size", "512", "--disable-cuda-graph",
            "--enable-hierarchical-cache", "--hicache-ratio", "4", "--hicache-io-backend", "direct",
            "--hicache-mem-layout", "layer_first", "--hicache-write-policy", policy,
            "--enable-metrics", "--log-level", "warning", "--skip-server-warmup",
        ]
        if trace:  # SGLang's own request spans: the parents otel-hicache's spans link to
            self.args += ["--enable-trace", "--otlp-traces-endpoint", otlp_endpoint.split("://")[-1]]
        base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        self.env = {
            **base,
            "PYTHONPATH": os.pathsep.join([str(CPU_SUPPORT)] + [p for p in [base.get("PYTHONPATH")] if p]),
            "SGLANG_USE_CPU_ENGINE": "1",
            # no NCCL on a CPU device: SGLang then all-reduces over gloo (tensor parallelism)
            "SGLANG_NCCL_SO_PATH": str(HERE / "no-nccl.so"),
            # one core set per rank (SGLang refuses more ranks than NUMA nodes otherwise)
            "SGLANG_CPU_OMP_THREADS_BIND": "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp)),
            "OTEL_SERVICE_NAME": service,
            "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_endpoint,
            "OTEL_METRIC_EXPORT_INTERVAL": "1000",
            "OTEL_BSP_SCHEDULE_DELAY": "500",
            **({} if plugin else {"SGLANG_PLUGINS": "none"}),  # SGLang loads only the plugins named
            **(env or {}),
        }

    # -- life cycle -------------------------------------------------------------------------
    def __enter__(self) -> "Server":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            # a session of its own: the whole tree can be signalled at once
            self.proc = subprocess.Popen(self.args, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} while starting:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/get_model_info", timeout=5) as r:
                    if r.status == 200:
                        self.seen.update(self.processes())
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"the server did not answer within {START_TIMEOUT_S:.0f} s:\n{self.tail()}")

    def processes(self) -> dict[int, int]:
        return descendants(self.proc.pid) if self.proc else {}

    def stop(self) -> list[int]:
        """Stop the whole tree (SIGTERM, then SIGKILL) and return the pids still alive (none)."""
        if self.proc is None:
            return []
        self.seen.update(self.processes())
        self.seen.add(self.proc.pid)
        for sig, wait_s in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
            for pid in self.seen:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            try:
                self.proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                pass
            deadline = time.monotonic() + wait_s
            while self.alive() and time.monotonic() < deadline:
                time.sleep(0.2)
            if not self.alive():
                break
        return self.alive()

    def alive(self) -> list[int]:
        """Pids of the tree still running (a zombie has ended)."""
        out = []
        for pid in sorted(self.seen):
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":
                out.append(pid)
        return out

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def schedulers(self) -> dict[int, str]:
        """``{pid: process title}`` of the scheduler processes (``sglang::scheduler_TP0`` ...)."""
        return {pid: _cmdline(pid).strip() for pid in self.processes() if "scheduler" in _cmdline(pid)}

    def telemetry_processes(self) -> dict[int, int]:
        """``{pid: parent pid}`` of otel-hicache's telemetry processes in the tree."""
        return {pid: ppid for pid, ppid in self.processes().items() if TELEMETRY_PROCESS in _cmdline(pid)}

    # -- requests and SGLang's own counters ---------------------------------------------------
    def generate(self, ids: list[int], max_new_tokens: int = 4) -> dict[str, float]:
        """One streamed request: its time to first token and time per output token (s)."""
        body = {"input_ids": ids, "stream": True,
                "sampling_params": {"max_new_tokens": max_new_tokens, "min_new_tokens": max_new_tokens,
                                    "temperature": 0}}
        req = urllib.request.Request(self.url + "/generate", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        started = time.perf_counter()
        first = last = None
        with urllib.request.urlopen(req, timeout=300) as r:
            for line in r:
                if line.startswith(b"data:") and line.strip() != b"data: [DONE]":
                    last = time.perf_counter()
                    first = first or last
        if first is None:
            raise RuntimeError("the server streamed no token")
        return {"ttft": first - started, "tpot": (last - first) / max(1, max_new_tokens - 1)}

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """SGLang's /metrics: ``{(sample name, sorted labels): value}``."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def hicache_counters(self) -> dict[tuple[str, str, str], float]:
        """``{(direction, "tokens"|"bytes", tp_rank): value}`` from SGLang's own counters."""
        got = self.metrics()
        out: dict[tuple[str, str, str], float] = {}
        for direction, names in SGLANG_COUNTERS.items():
            for what, name in zip(("tokens", "bytes"), names):
                for (sample, labels), value in got.items():
                    if sample == name:
                        rank = dict(labels).get("tp_rank", "0")
                        out[(direction, what, rank)] = out.get((direction, what, rank), 0.0) + value
        return out


def workload(server: Server, prefix: int = 400, fillers: int = 3, rounds: int = 2, seed: int = 0
             ) -> list[dict[str, float]]:
    """Force offload and load-back: a request with a prefix (cached on the device, backed up
    to the host), enough distinct fillers to evict it from the device pool (it stays on the
    host), then the prefix again (a host hit: a load-back). Returns each request's timings."""
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(3, 2000) for _ in range(n)]  # noqa: E731
    timings = []
    for _ in range(rounds):
        shared = tokens(prefix)
        timings.append(server.generate(shared + tokens(8)))
        for _ in range(fillers * server.tp):  # the device pool is per rank
            timings.append(server.generate(tokens(prefix)))
        timings.append(server.generate(shared + tokens(8)))
    return timings


# -- what reached Jaeger, keyed like SGLang's counters -------------------------------------------
SPAN_NAMES = {"offload": "hicache.offload", "onboard": "hicache.onboard"}


def transfer_spans(jaeger: Any, service: str, sglang: dict[tuple[str, str, str], float],
                   wait_s: float = 90.0) -> dict[str, list[dict[str, Any]]]:
    """Each direction's hicache spans in Jaeger (their tags, ``_trace``, ``_references``), waited
    for until their tokens reach SGLang's count or ``wait_s`` passes (a comparison then shows
    what is missing). ``jaeger`` is a ``check_pipeline.Jaeger``."""
    want = {d: sum(v for (dd, what, _), v in sglang.items() if dd == d and what == "tokens") for d in SPAN_NAMES}
    found: dict[str, list[dict[str, Any]]] = {}
    deadline = time.monotonic() + wait_s
    while True:
        for d, op in SPAN_NAMES.items():
            traces, _ = jaeger.traces(service, op, 1000)
            found[d] = [{**cp._tags(s), "_trace": s["traceID"], "_references": s.get("references") or []}
                        for _, s in cp._spans(traces, op)]
        if all(sum(int(t.get("hicache.tokens", 0)) for t in found[d]) >= want[d] for d in SPAN_NAMES) \
                or time.monotonic() > deadline:
            return found
        time.sleep(2.0)


def span_sums(spans: dict[str, list[dict[str, Any]]], by: str | None = "tp_rank"
              ) -> dict[tuple[str, str, str], float]:
    """``{(direction, "tokens"|"bytes", the value of attribute by, or "0" for by=None): sum}``."""
    out: dict[tuple[str, str, str], float] = {}
    for d, tags in spans.items():
        for t in tags:
            key = str(t.get(by, "0")) if by else "0"
            for what in ("tokens", "bytes"):
                out[(d, what, key)] = out.get((d, what, key), 0.0) + int(t[f"hicache.{what}"])
    return out
