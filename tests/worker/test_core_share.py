"""Replicas lending each other idle cores (``worker.core_share``): a step borrows the cores of idle siblings, gives
them back between layers once a sibling starts work, and an engine wired to a shared directory does so in its steps."""

import time

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.worker import core_share
from pagedllm.worker.core_share import CoreShare


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_step_borrows_idle_siblings_cores_and_gives_them_back(tmp_path, threads, monkeypatch):
    monkeypatch.setattr(core_share, "IDLE_AFTER_S", 0.05)
    a = CoreShare(str(tmp_path / "a.cores"), own_threads=1)
    b = CoreShare(str(tmp_path / "b.cores"), own_threads=2)
    (tmp_path / "notes.txt").write_bytes(b"\x01" * 64)  # not a replica's file: never read as one
    # both still loading (busy until end_step): nothing to borrow
    assert a.begin_step() == 1
    a.end_step()
    b.end_step()
    assert a.lendable() == 0  # b's last "step" (its load) ended just now: a gap between steps, not idle yet
    time.sleep(0.06)
    assert a.begin_step() == 3 and torch.get_num_threads() == 3  # its own core and b's two
    a.give_back()
    assert a.threads == 3  # b still idle: kept
    assert b.begin_step() == 2  # a is inside a step: b runs on its own cores
    a.give_back()  # between a's layers: b started, its cores go back
    assert a.threads == 1 and torch.get_num_threads() == 1
    a.end_step()
    b.end_step()
    assert a.stats == {"own_threads": 1, "steps": 2, "steps_on_borrowed_cores": 1, "cores_given_back": 2}
    time.sleep(0.06)
    assert b.begin_step() == 3  # a idle now: b borrows its core
    b.end_step()
    a.close()  # a replica that is gone lends its cores at once (until it is started again)
    assert b.lendable() == 1
    b.close()


def test_a_sibling_started_later_is_found(tmp_path, threads, monkeypatch):
    monkeypatch.setattr(core_share, "IDLE_AFTER_S", 0.0)
    a = CoreShare(str(tmp_path / "a.cores"), own_threads=1)
    a.end_step()
    assert a.lendable() == 0  # alone
    b = CoreShare(str(tmp_path / "b.cores"), own_threads=1)
    b.end_step()
    assert a.lendable() == 0  # the folder is listed again at most once a second
    a._listed -= 2.0
    assert a.lendable() == 1
    for f in tmp_path.iterdir():  # the folder removed under running replicas: the siblings they know still count
        f.unlink()
    tmp_path.rmdir()
    a._listed -= 2.0
    assert a.lendable() == 1
    a.close()
    b.close()


def test_an_engine_replica_runs_its_steps_on_an_idle_siblings_cores(tmp_path, threads):
    own = torch.get_num_threads()
    sibling = CoreShare(str(tmp_path / "replica-1.cores"), own_threads=1)
    sibling.end_step()
    time.sleep(core_share.IDLE_AFTER_S + 0.01)
    llm = LLM(core_share_file=str(tmp_path / "replica-0.cores"), max_model_len=256, enable_prefix_caching=False)
    runner = llm.engine.core.runner
    calls = []
    give_back = runner.model.between_layers
    assert give_back is not None
    runner.model.between_layers = lambda: (calls.append(torch.get_num_threads()), give_back())
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    alone = llm.generate(["The capital of France is"], sp)[0].outputs[0].token_ids
    stats = llm.engine.runtime["data_parallel_cores"]  # live counts
    steps = stats["steps"]
    assert steps >= 4 and stats["steps_on_borrowed_cores"] == steps
    assert sibling.lendable() == own  # the engine has no request left: lent at once, not after IDLE_AFTER_S
    assert set(calls) == {own + 1}  # every layer after the first ran on the borrowed core too
    # the sibling busy: the steps run on their own threads, with the same tokens
    sibling.begin_step()
    calls.clear()
    busy = llm.generate(["The capital of France is"], sp)[0].outputs[0].token_ids
    assert busy == alone and set(calls) == {own}
    assert stats["steps"] == 2 * steps and stats["steps_on_borrowed_cores"] == steps
    sibling.end_step()
    runner.shutdown()  # a replica that stops lends its core to the others at once
    assert sibling.lendable() == own and runner.core_share is None
    sibling.close()

