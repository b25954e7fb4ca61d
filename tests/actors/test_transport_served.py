"""The draft actor's transports and the served app's graph: same outputs as in-process, a killed
expert actor changes no output, an idle server does not burn a core.

These run on the session's Ray (the ``served`` app's), with draft actors of their own.
"""

import asyncio
import os
import time

import httpx
import psutil
import pytest
import ray
import torch

from actors.draft_server import DraftActorSpec, RemoteDrafter
from actors.expert_config import ExpertPoolConfig
from engine import SamplingParams
from engine.drafters.base import DraftRequest
from engine.drafters.draft_model import DraftModelDrafter
from engine.loader import load_model
from tests.actors.conftest import DRAFT, MODEL_NAME, kill_and_wait, wait_until


@pytest.mark.parametrize("graph", [True, False], ids=["compiled_graph", "actor_call"])
def test_remote_drafter_equals_in_process_and_survives_a_dead_actor(served, graph):
    spec = DraftActorSpec(DRAFT, "float32", "cpu", 4, None, None, f"test-draft-{graph}-{os.getpid()}", "specmoe")
    drafter = RemoteDrafter(spec, timeout_s=10.0, graph_config=ExpertPoolConfig(call_timeout_s=10.0) if graph else None)
    local = DraftModelDrafter(load_model(DRAFT, "float32", "cpu"), 4, None)
    reqs = lambda: [DraftRequest("a", list(range(5, 40)), 4), DraftRequest("b", list(range(50, 60)), 3),  # noqa: E731
                    DraftRequest("c", [7, 8, 9], 2, temperature=0.9, generator=torch.Generator().manual_seed(5)),
                    DraftRequest("d", list(range(70, 90)), 3, temperature=0.9, top_p=0.9, race_seed=8)]
    try:
        expected = local.propose(reqs())
        if graph:
            drafter.propose(reqs())
            wait_until(lambda: drafter.graph.live, 120, "the draft graph", poke=drafter.graph.request_build)
        for proposals in (drafter.propose(reqs()), drafter.propose(reqs())):
            assert [p.token_ids for p in proposals] == [p.token_ids for p in expected]
            torch.testing.assert_close(proposals[2].probs, expected[2].probs)
            assert proposals[3].probs is None and len(proposals[3].token_ids) == 3  # a race row ships no q
        kill_and_wait(drafter.member.handle)
        assert [p.token_ids for p in drafter.propose(reqs())] == [[], [], [], []]  # this step: no speculation
        assert drafter.num_failures == 1 and drafter.generation == 1
        wait_until(drafter.up, 120, "the re-created draft actor")  # until then steps draft nothing, no wait
        assert [p.token_ids for p in drafter.propose(reqs())] == [p.token_ids for p in expected]
    finally:
        drafter.close()
        ray.kill(drafter.member.handle)


def test_a_pipelined_draft_actor_drafts_the_next_window_during_verification(served):
    """The draft actor (a real Ray actor, by compiled graph) drafts ahead after answering: once
    the tokens are all accepted with the bonus token it guessed, the next proposal is that window
    (flagged pipelined) and equals the in-process draft model's window for those tokens."""
    spec = DraftActorSpec(DRAFT, "float32", "cpu", 4, None, None, f"test-draft-pipe-{os.getpid()}", "specmoe",
                          pipelined=True)
    drafter = RemoteDrafter(spec, timeout_s=10.0, graph_config=ExpertPoolConfig(call_timeout_s=10.0))
    local = DraftModelDrafter(load_model(DRAFT, "float32", "cpu"), 4, None)
    tokens = list(range(5, 40))
    try:
        drafter.propose([DraftRequest("warm", [1, 2, 3], 1)])
        wait_until(lambda: drafter.graph.live, 120, "the draft graph", poke=drafter.graph.request_build)
        first = drafter.propose([DraftRequest("a", tokens, 4)])[0]
        assert first.drafting_ahead and not first.pipelined
        assert first.token_ids == local.propose([DraftRequest("l", tokens, 4)])[0].token_ids
        guess = local.propose([DraftRequest("g", tokens + first.token_ids, 1)])[0].token_ids
        accepted = tokens + first.token_ids + guess
        ahead = drafter.propose([DraftRequest("a", accepted, 4)])[0]
        assert ahead.pipelined and ahead.token_ids == local.propose([DraftRequest("m", accepted, 4)])[0].token_ids
    finally:
        drafter.close()
        ray.kill(drafter.member.handle)


def _engine_stats(handle) -> dict:
    return handle.stats.remote().result(timeout_s=30)


def test_killing_an_expert_actor_in_the_served_graph_changes_no_output(served, reference_llm, heldout_prompts):
    url, config, handle = served
    # Short prompts: every layer of their prefill fits the graph's channels (a larger one goes by
    # actor calls, which would then be what meets the dead actor first).
    prompts = [row["prompt"][-120:] for row in heldout_prompts[7::29][:6]]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    expected = [o.outputs[0].text for o in reference_llm.generate(prompts, params)]

    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            async def one(prompt):
                body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
                r = await client.post(url + "/v1/completions", json=body)
                return r.json()["choices"][0]["text"]

            deadline = time.monotonic() + 120
            while not (await handle.stats.remote())["transport"]["graph_live"]:  # steady traffic builds it
                assert time.monotonic() < deadline, "the served graph did not build"
                await one(prompts[0])
            tasks = [asyncio.create_task(one(p)) for p in prompts]
            while (await handle.stats.remote())["num_running"] < len(prompts) // 2:
                await asyncio.sleep(0.02)
            before = (await handle.stats.remote())["transport"]
            names = await handle.expert_actor_names.remote()
            ray.kill(ray.get_actor(names[-1], namespace=config.experts.namespace))
            return before, await asyncio.gather(*tasks)

    before, texts = asyncio.run(run())
    assert before["graph_live"] and texts == expected
    after = _engine_stats(handle)["transport"]
    assert after["oversize"] == before["oversize"]
    assert after["failures"] == before["failures"] + 1


def _ray_worker_cpu_s(raylet_pid: int) -> dict[int, tuple[str, float]]:
    """(process title, CPU seconds) of every Ray worker process of the raylet ``raylet_pid``
    (``ray::`` processes it started: ``ray::IDLE`` for a pooled worker that holds no actor); another
    Ray cluster on the machine (a developer's server) is not this test's."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read().split(b"\0")[0].decode(errors="replace").strip()
            if not title.startswith("ray::"):
                continue
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == raylet_pid:  # fields[1]: the parent's pid
            out[int(pid)] = title, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


@ray.remote(num_cpus=0)
class _IdleReference:
    """An actor that does nothing: what an idle Ray worker process costs on this machine, now."""

    def pid(self) -> int:
        return os.getpid()


def _idle_graphs_parked(transport: dict) -> bool:
    return transport["graph_parked"] or not transport["graph_live"]


def test_an_idle_server_does_not_burn_a_core(served):
    url, config, handle = served
    body = {"model": MODEL_NAME, "prompt": "import os\n", "max_tokens": 8, "temperature": 0}
    assert httpx.post(url + "/v1/completions", json=body, timeout=120).status_code == 200
    # Live graphs are parked when idle: the janitor looks every <= 0.5 s once the graph has been
    # idle graph_idle_park_s; a loaded machine (CI beside other jobs) delays it, so poll, bounded.
    deadline_s = time.monotonic() + config.experts.graph_idle_park_s + 15.0
    time.sleep(config.experts.graph_idle_park_s + 0.5)
    while not _idle_graphs_parked(_engine_stats(handle)["transport"]) and time.monotonic() < deadline_s:
        time.sleep(0.5)
    transport = _engine_stats(handle)["transport"]
    assert _idle_graphs_parked(transport), transport
    reference = _IdleReference.remote()
    reference_pid = ray.get(reference.pid.remote())
    raylet_pid = psutil.Process(reference_pid).ppid()  # the raylet that started this cluster's workers
    before = _ray_worker_cpu_s(raylet_pid)
    assert len(before) >= 8, before  # the app's actors, Serve's and the reference are all found
    window_s = 60.0
    time.sleep(window_s)
    after = _ray_worker_cpu_s(raylet_pid)
    ray.kill(reference)
    used = {p: (after[p][0], after[p][1] - before[p][1]) for p in before if p in after}
    # Every Ray worker, doing nothing, costs its core worker's own timers: 0.5 CPU s a minute on the
    # dev VM, 0.8 on CI's, so any bound on a sum of processes is measured against an actor that
    # does nothing, in the same minute. A polling compiled-graph reader burns 20-60 s of this
    # minute in its own process, which can be any of the app's actors or the compiled graphs'
    # driver proxies; idle, each is within ~0.4 s of the reference.
    idle_s = used[reference_pid][1]
    system = ("ray::ServeController", "ray::ProxyActor", "ray::DashboardAgent", "ray::RuntimeEnvAgent", "ray::IDLE")
    app = {p: (title, s) for p, (title, s) in used.items() if p != reference_pid and not title.startswith(system)}
    busiest = max(s for _, s in app.values())
    assert busiest < 0.05 * window_s, f"a Ray worker used {busiest:.1f} CPU s in an idle {window_s:.0f} s: {used}"
    # The app's processes together, beyond what as many idle workers cost: several actors each
    # waking often (a reader polling with a sleep) add up here without any one being the busiest.
    excess_s = sum(max(0.0, s - idle_s) for _, s in app.values())
    assert excess_s < 0.05 * window_s, (
        f"the app's {len(app)} Ray workers used {excess_s:.1f} CPU s idle beyond an idle actor's "
        f"{idle_s:.2f} s each: {used}")
    # Ray's and Serve's own processes run their own loops (Serve's controller reconciles every
    # 0.1 s: 1.6-3.3 CPU s a minute measured); none of them may spin either.
    for title, s in used.values():
        assert s < 0.1 * window_s, f"{title} used {s:.1f} CPU s in an idle {window_s:.0f} s: {used}"


def test_releases_do_not_pile_up_while_nothing_drafts(served):
    from actors.draft_server import MAX_PENDING_RELEASES

    spec = DraftActorSpec(DRAFT, "float32", "cpu", 4, None, None, f"test-draft-release-{os.getpid()}", "specmoe")
    drafter = RemoteDrafter(spec, timeout_s=30.0)
    try:
        drafter.propose([DraftRequest("kept", list(range(5, 30)), 2)])
        for i in range(MAX_PENDING_RELEASES + 10):
            drafter.release(f"gone-{i}")
        assert len(drafter._released) == 10  # the first MAX_PENDING_RELEASES went on their own
        drafter.release("kept")
        drafter.propose([DraftRequest("kept", list(range(5, 30)), 2)])  # its cache was released: a miss
        assert ray.get(drafter.member.handle.num_cache_misses.remote()) == 2
    finally:
        ray.kill(drafter.member.handle)
