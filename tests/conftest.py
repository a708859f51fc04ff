from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import _forked
import pytest
import torch
from _cli import Run, in_process
from ckpt_engine_plugins.pinned_staging import process as writer_process
from hypothesis import HealthCheck, settings

# Hypothesis profiles: fast by default, exhaustive with CKPT_ENGINE_HYPOTHESIS=thorough.
settings.register_profile(
    "ci", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("thorough", max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("CKPT_ENGINE_HYPOTHESIS", "ci"))

torch.set_num_threads(1)
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


# CKPT_ENGINE_TEST_WRITERS=fresh runs every test on writers in new interpreters, as users' jobs do.
if _forked.forks_writers(os.environ):
    writer_process.start_writer = _forked.forked_writer


@pytest.fixture
def fresh_writers(monkeypatch: pytest.MonkeyPatch) -> None:
    """This test's ``pinned_staging`` writers start as users' do, in a new interpreter."""
    monkeypatch.setattr(writer_process, "start_writer", writer_process.popen_writer)


@pytest.fixture
def forked_python(monkeypatch: pytest.MonkeyPatch) -> str:
    """``sys.executable`` is the ``python`` stand-in (tests/_forked_python.py) for the test: the
    Python processes the code under test starts (``check_exact_resume``'s runs) fork from the fork
    server instead of importing torch anew. ``CKPT_ENGINE_TEST_PYTHON=fresh`` keeps new interpreters."""
    stand_in = _forked.python_stand_in()
    monkeypatch.setenv(_forked.ADDRESS_VAR, _forked.server_address())
    monkeypatch.setattr(sys, "executable", stand_in)
    return stand_in


@pytest.fixture
def save_dir(tmp_path: Any) -> str:
    return str(tmp_path / "checkpoints")


@pytest.fixture
def one_rank_mesh() -> Any:
    """A 1-rank gloo process group (in-memory store, no port) and a CPU device mesh over it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def s3_server() -> Any:
    """moto's S3 server on loopback for the whole session (tests/_s3.py)."""
    from _s3 import S3Server

    server = S3Server()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server: Any) -> Any:
    """A fresh bucket on the session's S3 server; the server is running again afterwards."""
    from _s3 import new_bucket

    s3_server.start()
    bucket = new_bucket(s3_server)
    yield bucket
    s3_server.start()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every ``dist`` test belongs to the full tier (``full``), before ``-m`` selects a tier.
    Without CUDA, ``cuda`` tests are deselected: reported as such, never counted as passed."""
    for item in items:
        if item.get_closest_marker("dist") is not None and item.get_closest_marker("full") is None:
            item.add_marker(pytest.mark.full)
    _schedule(items)
    if torch.cuda.is_available():
        return
    kept = [item for item in items if item.get_closest_marker("cuda") is None]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("cuda")])
        items[:] = kept


def _cost(item: pytest.Item) -> int:
    """0 for torchrun tests, 1 for the rest of the full tier, 2 for the fast tier."""
    if item.get_closest_marker("dist") is not None:
        return 0
    return 1 if item.get_closest_marker("full") is not None else 2


def _schedule(items: list[pytest.Item]) -> None:
    """Order the tests for the workers of ``-n N`` (``--dist loadscope --no-loadscope-reorder``,
    pyproject.toml): each module goes to one worker, in this order, so a module-scoped fixture
    (a shared torchrun launch, a trained model) runs once, not once on each worker that got one
    of its tests. Modules with torchrun tests start first, then the rest of the full tier, then
    the fast tier: the longest tests do not start last, with one worker idle while the other
    finishes them. A module's tests stay together and in their order."""
    module_cost: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        module_cost[module] = min(module_cost.get(module, 2), _cost(item))
    items.sort(key=lambda item: module_cost[item.nodeid.split("::", 1)[0]])


@pytest.fixture(autouse=True)
def _declared_tier(request: pytest.FixtureRequest) -> Any:
    """A torchrun launch from a test without the ``dist`` marker fails it: the fast tier
    (``-m "not full"``) must never start ranks it was not told about."""
    import _torchrun

    _torchrun.launch_allowed = request.node.get_closest_marker("dist") is not None
    yield
    _torchrun.launch_allowed = True


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Run:
    """Run the CLI in-process: ``cli(*argv)`` returns (exit code, stdout, stderr)."""
    return in_process(capsys)
