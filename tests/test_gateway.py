"""`engine serve` replicas behind the real SGLang model gateway (`smg launch`), on 127.0.0.1, with the
real `openai` client: the worker routes the gateway reads, round robin's spread, cache-aware routing
against round robin on prefix groups, draining a replica, and a replica killed and restarted under
load. Two replicas of a tiny model are shared by the module; each test starts its own gateway (a
Rust process, up in a second) in front of them."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from engine.bench.prefix_groups import hit_rate, prefix_groups, run_completions
from engine.serve import gateway
from helpers import wait_gone
from server_helpers import free_port, start_server, stop_server

openai = pytest.importorskip("openai")


def _have_smg() -> bool:
    try:
        gateway.smg_command()
    except FileNotFoundError:
        return False
    return True


pytestmark = pytest.mark.skipif(
    not _have_smg(), reason="the SGLang model gateway is not installed (pip install smg==1.13.0)"
)

LONG = 1000  # tokens of a request that runs while the gateway drains its replica
POOL = 1200  # KV tokens per replica: four 268-token prompts and room for those running beside them


def replica(model_dir: str, port: int = 0):
    return start_server(
        "--model-path",
        model_dir,
        "--max-total-tokens",
        str(POOL),
        "--num-threads",
        "1",
        "--port",
        str(port),
    )


@pytest.fixture(scope="module")
def replicas(tiny_llama_dir):
    servers = [replica(tiny_llama_dir), replica(tiny_llama_dir)]
    yield servers
    for s in servers:
        if s.proc.poll() is None:
            stop_server(s)


@pytest.fixture(scope="module")
def model_name(replicas) -> str:
    return httpx.get(replicas[0].url + "/v1/models").json()["data"][0]["id"]


class Gateway:
    def __init__(self, urls: list[str], policy: str, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = gateway.launch_command(urls, "127.0.0.1", self.port, policy, free_port(), None, extra)
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        assert gateway.wait_routing(self.url, urls, 60, alive=self.alive), "".join(self.lines)
        # every worker's load polled once: until then cache-aware places new prefixes by coin toss
        assert gateway.wait_loads(self.url, urls, 30, alive=self.alive), "".join(self.lines)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def client(self):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def worker(self, url: str) -> dict | None:
        return next((w for w in gateway.workers(self.url) if w.get("url") == url), None)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def make_gateway():
    started: list[Gateway] = []

    def make(urls, policy, *extra) -> Gateway:
        started.append(Gateway(list(urls), policy, *extra))
        return started[-1]

    yield make
    for g in started:
        g.stop()


def stats(servers) -> list[dict]:
    return [httpx.get(s.url + "/stats", timeout=30).json() for s in servers]


def finished(servers) -> list[int]:
    return [s["finished_requests"] for s in stats(servers)]


# ---------------------------------------------------------------------- what the gateway reads


def test_a_replica_answers_every_route_the_gateway_reads(replicas, model_name):
    url = replicas[0].url
    models = httpx.get(url + "/v1/models").json()["data"]
    assert models[0]["owned_by"] == "engine"  # unknown to the gateway: it then probes
    assert httpx.get(url + "/version").status_code == 404  # vLLM's, absent: so not vLLM
    for route in ("/server_info", "/get_server_info"):
        info = httpx.get(url + route).json()
        assert info["model"] == model_name and info["served_model_name"] == model_name
        assert info["tp_size"] >= 1 and info["dp_size"] == 1
        assert info["max_total_tokens"] == POOL and info["context_length"] > 0
        assert "model_id" not in info  # `model` is its alias in the gateway: both would clash
    for route in ("/model_info", "/get_model_info"):
        info = httpx.get(url + route).json()
        assert info["is_generation"] is True and info["model_type"] == "llama"
        assert info["architectures"] == ["LlamaForCausalLM"]
    loads = httpx.get(url + "/v1/loads?include=core,disagg,queues,memory").json()
    assert loads["dp_rank_count"] == 1 and len(loads["loads"]) == 1
    load = loads["loads"][0]
    assert load["max_total_num_tokens"] == POOL and load["num_used_tokens"] >= 0
    assert 0 <= load["token_usage"] <= 1 and load["num_running_reqs"] == 0
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/health_generate", timeout=60).status_code == 200
    assert "flushed_tokens" in httpx.post(url + "/flush_cache").json()


def test_the_gateway_registers_replicas_and_fans_out_flush_cache(
    replicas, make_gateway, model_name
):
    urls = [s.url for s in replicas]
    g = make_gateway(urls, "round_robin")
    listed = {w["url"]: w for w in gateway.workers(g.url)}
    assert set(listed) == set(urls)
    out = g.client().chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert out.choices[0].finish_reason in ("stop", "length")
    for s in replicas:  # each replica holds a cached prefix now or after one more request
        g.client().completions.create(model=model_name, prompt="one two three", max_tokens=2)
    assert httpx.post(g.url + "/flush_cache", timeout=30).status_code == 200
    assert all(st["cache_evictable_tokens"] == 0 for st in stats(replicas))


# ---------------------------------------------------------------------- routing


@pytest.mark.parametrize("count", [40, pytest.param(200, marks=pytest.mark.stress)])
def test_round_robin_spreads_requests_evenly(replicas, make_gateway, model_name, count):
    g = make_gateway([s.url for s in replicas], "round_robin")
    client = g.client()
    before = finished(replicas)
    with ThreadPoolExecutor(4) as pool:
        outs = list(
            pool.map(
                lambda i: client.completions.create(
                    model=model_name, prompt=f"Request {i}:", max_tokens=2
                ),
                range(count),
            )
        )
    assert len(outs) == count
    spread = [a - b for a, b in zip(finished(replicas), before)]
    assert sum(spread) == count and max(spread) - min(spread) <= 2, spread


@pytest.mark.parametrize("per_group", [8, pytest.param(25, marks=pytest.mark.stress)])
def test_cache_aware_routing_serves_far_more_prompt_tokens_from_cache(
    replicas, make_gateway, model_name, per_group, record_property
):
    """8 prefix groups of about 256 tokens, shuffled, at concurrency 4; each replica's pool holds
    about four prefixes.
    Round robin sends every group to both replicas, which evict each other's prefixes; cache-aware
    routing keeps a group on one replica, placing each new group by the replicas' loads (the
    gateway's defaults here, gateway.launch_command; docs/scale-out.md, Cache-aware routing)."""
    workload = prefix_groups(8, per_group, 256, seed=0)
    urls = [s.url for s in replicas]
    rates, spread, seconds = {}, {}, {}
    for policy in ("round_robin", "cache_aware"):
        g = make_gateway(urls, policy)
        assert httpx.post(g.url + "/flush_cache", timeout=30).status_code == 200
        before = stats(replicas)
        start = time.monotonic()
        run_completions(g.client(), model_name, workload, concurrency=4, max_tokens=2)
        seconds[policy] = round(time.monotonic() - start, 2)
        after = stats(replicas)
        rates[policy] = hit_rate(before, after)
        spread[policy] = [
            a["finished_requests"] - b["finished_requests"] for b, a in zip(before, after)
        ]
        g.stop()
    shown = {policy: round(rate, 3) for policy, rate in rates.items()}
    figures = {"hit_rate": shown, "requests_per_replica": spread, "seconds": seconds}
    record_property("figures", figures)
    print(f"cache-aware against round robin, 8 x {per_group}: {figures}")
    # the groups split 4 to 4 or 5 to 3; the short form's first requests are a larger share of it
    # (figures: docs/scale-out.md, Measured here)
    least = 0.30 if per_group >= 25 else 0.20
    assert rates["cache_aware"] >= rates["round_robin"] + least, figures


# ---------------------------------------------------------------------- draining and failures


def test_a_drained_replica_gets_no_new_request_and_finishes_its_running_ones(
    replicas, make_gateway, model_name
):
    """The gateway drains a worker on DELETE /workers/{id}: no new request is routed to it while its
    running ones go on; it is removed after the drain settle time, here made long enough."""
    urls = [s.url for s in replicas]
    g = make_gateway(urls, "round_robin")
    client = g.client()
    drained = g.worker(urls[0])
    settle = httpx.patch(
        f"{g.url}/workers/{drained['id']}", json={"health": {"drain_settle_secs": 60}}, timeout=10
    )
    assert settle.status_code < 300, settle.text
    long = {"model": model_name, "prompt": "Count:", "max_tokens": LONG}
    long_extra = {"ignore_eos": True}
    with ThreadPoolExecutor(2) as pool:
        running = [
            pool.submit(client.completions.create, **long, extra_body=long_extra) for _ in range(2)
        ]
        deadline = time.monotonic() + 30
        # one on each replica
        while any(s["running"] == 0 for s in stats(replicas)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(s["running"] == 1 for s in stats(replicas))
        assert httpx.delete(f"{g.url}/workers/{drained['id']}", timeout=10).status_code < 300
        deadline = time.monotonic() + 5
        while (g.worker(urls[0]) or {}).get("status") not in ("draining", None):
            assert time.monotonic() < deadline, g.worker(urls[0])
            time.sleep(0.05)
        before = finished(replicas)
        for i in range(6):
            client.completions.create(model=model_name, prompt=f"New {i}:", max_tokens=2)
        now = stats(replicas)
        after = [s["finished_requests"] for s in now]
        assert after[0] == before[0] and after[1] == before[1] + 6, (before, after)
        assert now[0]["running"] == 1  # its request ran all along
        outs = [f.result(timeout=120) for f in running]
    assert [o.usage.completion_tokens for o in outs] == [LONG, LONG]
    assert all(o.choices[0].finish_reason == "length" for o in outs)


@pytest.mark.parametrize("count", [40, pytest.param(200, marks=pytest.mark.stress)])
def test_a_replica_killed_under_load_loses_no_request_and_serves_again_once_restarted(
    replicas, make_gateway, model_name, tiny_llama_dir, count, record_property
):
    """SIGKILL one replica's server while non-streaming requests run at concurrency 4: the gateway
    retries what failed on the other, marks the dead one not ready within 3 s, and routes to it
    again once a replica is back on its address (re-added if the gateway had given up on it).
    Streams run beside them: one the kill cuts cannot be retried once it has sent; each stream
    either finishes or is counted as cut (the count is the test's `cut_streams` property)."""
    urls = [s.url for s in replicas]
    g = make_gateway(urls, "round_robin")
    client = g.client()
    victim = replicas[1]
    pids = httpx.get(victim.url + "/server_info").json()["pids"]
    done: list = []
    killed_at: list[float] = []

    def one(i: int):
        if i == count // 4:
            os.kill(pids["user"], signal.SIGKILL)
            killed_at.append(time.monotonic())
        out = client.completions.create(model=model_name, prompt=f"Load {i}:", max_tokens=8)
        done.append(out)
        return out

    marked: list[float] = []

    def watch() -> None:
        while not killed_at:
            time.sleep(0.01)
        while time.monotonic() - killed_at[0] < 10:
            w = g.worker(victim.url)
            if w is None or not gateway.is_ready(w):
                marked.append(time.monotonic() - killed_at[0])
                return
            time.sleep(0.05)

    streams = {"finished": 0, "cut": 0}
    load_done = threading.Event()

    def stream() -> None:
        while not load_done.is_set():
            reason = None
            try:
                for chunk in client.completions.create(
                    model=model_name, prompt="Stream:", max_tokens=16, stream=True
                ):
                    reason = chunk.choices[0].finish_reason if chunk.choices else reason
            except openai.APIError:
                reason = None
            streams["finished" if reason else "cut"] += 1

    watcher, streamer = threading.Thread(target=watch), threading.Thread(target=stream)
    watcher.start()
    streamer.start()
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(one, range(count)))
    load_done.set()
    watcher.join()
    streamer.join(60)
    record_property("cut_streams", streams["cut"])
    # at most the one in flight (+1)
    assert streams["finished"] > 0 and streams["cut"] <= 2, streams
    assert len(outs) == count and all(o.choices[0].text is not None for o in outs)
    assert marked and marked[0] <= 3.0, marked
    assert wait_gone(list(pids.values()), 10) == []

    port = int(victim.url.rsplit(":", 1)[1])
    replicas[1] = victim = replica(tiny_llama_dir, port)
    w = g.worker(victim.url)
    if w is None or str(w.get("status")).lower() == "failed":  # given up on: add it again
        if w is not None:
            httpx.delete(f"{g.url}/workers/{w['id']}", timeout=10)
            deadline = time.monotonic() + 30
            while g.worker(victim.url) is not None and time.monotonic() < deadline:
                time.sleep(0.2)
        added = httpx.post(g.url + "/workers", json={"url": victim.url}, timeout=10)
        assert added.status_code < 300, added.text
    assert gateway.wait_routing(g.url, urls, 30), gateway.workers(g.url)
    before = finished(replicas)
    for i in range(6):
        client.completions.create(model=model_name, prompt=f"Back {i}:", max_tokens=2)
    spread = [a - b for a, b in zip(finished(replicas), before)]
    assert spread[1] >= 2, spread


# ---------------------------------------------------------------------- /health


@pytest.mark.parametrize("role", ["scheduler", "detokenizer"])
def test_a_dead_engine_child_fails_health_at_once(tiny_llama_dir, role):
    srv = start_server("--model-path", tiny_llama_dir, "--num-threads", "1")
    try:
        pids = httpx.get(srv.url + "/server_info").json()["pids"]
        assert httpx.get(srv.url + "/health").status_code == 200
        os.kill(pids[role], signal.SIGKILL)
        killed = time.monotonic()
        while time.monotonic() - killed < 3:
            try:
                status = httpx.get(srv.url + "/health", timeout=1).status_code
            except httpx.HTTPError:
                status = None  # the server stopped: the gateway's probe fails as well
            if status != 200:
                break
            time.sleep(0.02)
        assert status != 200, "/health still answered 200 three seconds after the kill"
        assert srv.proc.wait(30) == 1, srv.output()
        assert wait_gone(list(pids.values()), 10) == []
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
