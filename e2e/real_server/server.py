"""`python -m sglang.launch_server` with HiCache on CPU, as users start it (a tiny local model, the
stand-ins of cpu/): otel-hicache's plugin loaded by SGLang in each scheduler, configured by OTEL_*."""

import contextlib
import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
from helpers import DIRECTIONS, SPAN_NAMES, Jaeger, free_port, settle

HERE = Path(__file__).resolve().parent
FLAGS = ("--device cpu --attention-backend torch_native --sampling-backend pytorch --dtype bfloat16 --max-total-tokens"
         " 1024 --max-running-requests 4 --chunked-prefill-size 512 --disable-cuda-graph --enable-hierarchical-cache"
         " --hicache-ratio 4 --hicache-io-backend direct --hicache-mem-layout layer_first --enable-metrics"
         " --log-level warning --skip-server-warmup")
# SGLang's own counters (its /metrics) of what HiCache moved
SGLANG_COUNTERS = {f"sglang:{name}_{what}_total": (d, what) for d, name in (
    ("offload", "hicache_backup"), ("onboard", "load_back")) for what in ("tokens", "bytes")}


def make_model(out: Path) -> Path:
    """A random-weight Llama and a BPE tokenizer trained on the stdlib's sources: no download."""
    if not (out / "tokenizer.json").exists():
        import torch
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

        tok = Tokenizer(models.BPE(unk_token=None))
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        tok.train(sorted(str(p) for p in Path(os.__file__).parent.glob("*.py"))[:60], trainers.BpeTrainer(
            vocab_size=2048, special_tokens=["<s>", "</s>", "<pad>"], show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=len(fast), max_position_embeddings=4096, bos_token_id=fast.bos_token_id, torch_dtype="bfloat16",
            eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id, tie_word_embeddings=False,
        )).to(torch.bfloat16).save_pretrained(out)
        fast.save_pretrained(out)
    return out


class Server:
    """`with Server(...)` starts it, waits until it answers, stops its whole process tree after."""

    def __init__(self, model: Path, log: Path, *, policy: str = "write_through", page_size: int = 1, tp: int = 1,
                 trace: bool = False, plugin: bool = True, service: str = "sglang-cpu",
                 otlp_endpoint: str = "http://127.0.0.1:4317") -> None:
        self.port, self.log, self.tp, self.proc = free_port(), log, tp, None
        self.url = f"http://127.0.0.1:{self.port}"
        self.tree: set[psutil.Process] = set()  # each process of it seen running
        self.args = [sys.executable, "-m", "sglang.launch_server", *FLAGS.split(), "--model-path", str(model),
                     "--port", str(self.port), "--tp", str(tp), "--page-size", str(page_size),
                     "--hicache-write-policy", policy]
        self.args += ["--enable-trace", "--otlp-traces-endpoint", otlp_endpoint.split("://")[-1]] * trace
        base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        self.env = base | {
            "PYTHONPATH": os.pathsep.join([str(HERE / "cpu"), *filter(None, [base.get("PYTHONPATH")])]),
            "SGLANG_USE_CPU_ENGINE": "1", "SGLANG_NCCL_SO_PATH": str(HERE / "none.so"),  # gloo, not NCCL
            # a core set per rank, or SGLang refuses more ranks than NUMA nodes
            "SGLANG_CPU_OMP_THREADS_BIND": "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp)),
            "OTEL_SERVICE_NAME": service, "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_endpoint,
            "OTEL_METRIC_EXPORT_INTERVAL": "1000", "OTEL_BSP_SCHEDULE_DELAY": "500",
        } | ({} if plugin else {"SGLANG_PLUGINS": "none"})  # only the plugins named load

    def __enter__(self) -> "Server":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        with open(self.log, "ab") as log:  # its own session: a terminal's ^C goes through stop()
            self.proc = subprocess.Popen(self.args, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        try:  # a cold start on 2 busy cores, TP 2 included
            assert settle(self._answers, bool, 420, every=1), f"no answer (log {self.log})"
        except BaseException:
            self.stop()
            raise

    def _answers(self) -> bool:
        assert self.proc.poll() is None, f"the server exited ({self.proc.returncode}); log {self.log}"
        with contextlib.suppress(OSError), urllib.request.urlopen(self.url + "/get_model_info", timeout=5):
            self.tree |= set(self.processes())
            return True
        return False

    def stop(self) -> None:
        """SIGTERM to every process of the tree, then SIGKILL to what is left."""
        self.tree |= set(self.processes())
        for kill in (False, True):
            for p in self.tree:
                with contextlib.suppress(psutil.Error):
                    p.kill() if kill else p.terminate()
            if not settle(self.alive, lambda left: not left, 10 if kill else 30):
                break

    def alive(self) -> list[int]:  # the tree's running pids (a zombie has ended)
        if self.proc:
            self.proc.poll()  # reaps the server itself
        return sorted(p.pid for p in self.tree if _is(p, "status") not in ("", psutil.STATUS_ZOMBIE))

    def processes(self) -> list[psutil.Process]:
        with contextlib.suppress(psutil.Error, AttributeError):
            return [root := psutil.Process(self.proc.pid), *root.children(recursive=True)]
        return []

    def schedulers(self) -> dict[int, str]:  # {pid: title, sglang::scheduler_TP0 ...}
        return {p.pid: _is(p, "cmdline") for p in self.processes() if "scheduler" in _is(p, "cmdline")}

    def telemetry_processes(self) -> dict[int, int]:  # {pid: parent pid}
        return {p.pid: p.ppid() for p in self.processes() if "otel_hicache.sinks.process" in _is(p, "cmdline")}

    def generate(self, ids: list[int], new: int = 4) -> dict[str, float]:
        """A streamed request: its time to first token and per output token (s)."""
        body = {"input_ids": ids, "stream": True, "sampling_params": {
            "max_new_tokens": new, "min_new_tokens": new, "temperature": 0}}
        started = time.perf_counter()
        with urllib.request.urlopen(urllib.request.Request(self.url + "/generate", json.dumps(body).encode(), {
                "Content-Type": "application/json"}), timeout=300) as r:
            times = [time.perf_counter() for line in r if line.startswith(b"data:") and b"[DONE]" not in line]
        assert times, "the server streamed no token"
        return {"ttft": times[0] - started, "tpot": (times[-1] - times[0]) / max(1, new - 1)}

    def hicache_counters(self) -> dict[tuple[str, str, str], float]:
        """{(direction, "tokens"|"bytes", tp_rank): value} of SGLang's own counters."""
        from prometheus_client.parser import text_string_to_metric_families

        out, text = {}, urllib.request.urlopen(self.url + "/metrics", timeout=30).read().decode()
        for family in text_string_to_metric_families(text):
            for s in (s for s in family.samples if s.name in SGLANG_COUNTERS):
                key = (*SGLANG_COUNTERS[s.name], s.labels.get("tp_rank", "0"))
                out[key] = out.get(key, 0.0) + s.value
        return out

    def settled_counters(self) -> dict[tuple[str, str, str], float]:
        """hicache_counters() once two reads a second apart agree (the last acks counted)."""
        seen: list = []
        read = lambda: seen.append(self.hicache_counters()) or seen[-1]  # noqa: E731
        return settle(read, lambda now: seen[-2:-1] == [now], 30, every=1)


def _is(p: psutil.Process, what: str) -> str:  # status or command line, "" once gone
    with contextlib.suppress(psutil.Error):
        return p.status() if what == "status" else " ".join(p.cmdline())
    return ""


def workload(server: Server, prefix: int = 400, fillers: int = 3, rounds: int = 2, seed: int = 0) -> list[dict]:
    """rounds times: a prefix (backed up), fillers evicting it from the device, the prefix again (a
    load-back). Each request's timings."""
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(3, 2000) for _ in range(n)]  # noqa: E731
    timings = []
    for shared in (tokens(prefix) for _ in range(rounds)):
        timings.append(server.generate(shared + tokens(8)))
        timings += [server.generate(tokens(prefix)) for _ in range(fillers * server.tp)]  # a pool a rank
        timings.append(server.generate(shared + tokens(8)))
    return timings


def transfer_spans(jaeger: Jaeger, service: str, sglang: dict) -> dict[str, list[dict]]:
    """Each direction's hicache spans in Jaeger once their tokens reach SGLang's (or 90 s)."""
    want = {d: sum(v for k, v in sglang.items() if k[:2] == (d, "tokens")) for d in DIRECTIONS}
    return settle(lambda: {d: jaeger.spans(service, op, limit=1000) for d, op in SPAN_NAMES.items()}, lambda got: all(
        sum(s["attrs"]["hicache.tokens"] for s in got[d]) >= want[d] for d in DIRECTIONS), 90, every=2)


def span_sums(spans: dict[str, list[dict]], by: str | None = "tp_rank") -> dict[tuple[str, str, str], float]:
    """{(direction, "tokens"|"bytes", attribute by's value, "0" for None): sum}."""
    out: dict = {}
    for d, s, what in ((d, s, what) for d in spans for s in spans[d] for what in ("tokens", "bytes")):
        key = (d, what, str(s["attrs"].get(by, "0")) if by else "0")
        out[key] = out.get(key, 0.0) + s["attrs"][f"hicache.{what}"]
    return out
