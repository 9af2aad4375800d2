"""A learner group across hosts, what runs without other hosts: its bad input, and how rank 0's state
travels to the followers. The group itself, trained across network namespaces, is
tests/test_netns_learners.py.

Bad input (wrong group flags, or a torchrun environment no launcher would set) is one line and exit 2
before anything starts: a rank that started would wait at the rendezvous for hosts that never come.
Each case calls the real ``main`` in this process, as tests/test_bad_flags.py does.
"""

from __future__ import annotations

import json

import pytest
import torch

from learner.cli import launch_impala
from learner.group import _layout, _rebuild

TINY = ["--env", "CartPole-v1", "--workers", "1", "--total-frames", "64", "--unroll-length", "8"]
TINY += ["--batch-size", "2", "--minibatches", "1", "--no-progress"]
GROUP = ["--learners", "2", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:29400"]
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME")

CASES = {
    "node rank >= nnodes": (
        ["--learners", "2", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:29400"],
        {},
        "--node-rank 2: a group of --learners 2 hosts has node ranks 0..1",
    ),
    "no endpoint": (
        ["--learners", "2", "--node-rank", "1"],
        {},
        "--node-rank needs --rdzv-endpoint HOST:PORT",
    ),
    "no node rank": (
        ["--learners", "2", "--rdzv-endpoint", "127.0.0.1:29400"],
        {},
        "--rdzv-endpoint needs --node-rank R",
    ),
    "endpoint without a port": (
        ["--learners", "2", "--node-rank", "0", "--rdzv-endpoint", "learner0"],
        {},
        "--rdzv-endpoint 'learner0': give HOST:PORT",
    ),
    "one learner": (
        ["--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:29400"],
        {},
        "give --learners N (the number of hosts, N >= 2), got 1",
    ),
    "loopback bind across hosts": (
        ["--learners", "2", "--node-rank", "1", "--rdzv-endpoint", "10.77.200.1:29400"],
        {},
        "--bind 127.0.0.1 is this host's loopback, which no other host reaches",
    ),
    "bind of another host": (
        ["--learners", "2", "--node-rank", "1", "--rdzv-endpoint", "10.77.200.1:29400", "--bind", "192.0.2.7"]
        + ["--insecure-bind"],
        {},
        "--bind 192.0.2.7: no network interface of this host has that address",
    ),
    "batch not divisible": (
        [*GROUP, "--batch-size", "3"],
        {},
        "--learners 2 splits each batch: --batch-size 3 must divide by it",
    ),
    "torchrun environment without its store": (
        [],
        {"RANK": "0", "WORLD_SIZE": "2"},
        "MASTER_ADDR, MASTER_PORT are not set",
    ),
    "torchrun rank >= world size": (
        [],
        {"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"},
        "rank 2 of a group of 2: a node rank must be 0..nnodes-1",
    ),
    "--learners other than torchrun's": (
        ["--learners", "3"],
        {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"},
        "--learners 3, but torchrun started 2 ranks",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_group_input_is_one_line_and_exit_2(case, tmp_path, capsys, monkeypatch):
    argv, env, says = CASES[case]
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    try:
        rc = launch_impala.main([*TINY, "--logdir", str(tmp_path / "run"), *argv])
    except SystemExit as e:  # argparse
        rc = e.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line[:4].isdigit()]  # log lines aside
    assert rc == 2 and "Traceback" not in err, err[-3000:]
    assert len(lines) == 1 and lines[0].startswith("launch_impala: error: ") and says in lines[0], lines
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


def test_a_group_across_hosts_is_refused_from_python(tmp_path, monkeypatch):
    """``impala.train`` runs ``launch`` in its caller's process, which cannot become torchrun's agent:
    the group flags are refused there rather than ignored (a lone learner that thinks it is rank 0)."""
    from learner.run.runtime import LaunchError

    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(LaunchError, match="start it with the launch_impala command, not from Python"):
        launch_impala.launch([*TINY, *GROUP, "--logdir", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()


def test_rank_0s_state_reaches_a_follower_as_json_and_raw_bytes_unchanged():
    """What a follower receives on --resume (a learner's state_dict: weights, PopArt buffers, the
    optimizer's per-parameter state under int keys, its hyper-parameters with tuples and None) is
    rebuilt equal from its JSON layout and the tensors' raw bytes, nothing unpickled."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model.register_buffer("sigma", torch.tensor([1.5], dtype=torch.float64))
    model.register_buffer("empty", torch.zeros(0, 5))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.99))
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "updates": 7,
        "mask": torch.tensor([True, False]),
        "half": torch.randn(3, dtype=torch.bfloat16),
    }
    tensors: list[torch.Tensor] = []
    layout = json.loads(json.dumps(_layout(state, tensors)))  # what travels: text, then bytes
    payload = b"".join(
        t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors
    )
    got = _rebuild(layout, payload, [0])

    def same(a, b):
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        elif isinstance(a, dict):
            assert list(a) == list(b)  # the optimizer's parameter ids stay ints
            for k in a:
                same(a[k], b[k])
        elif isinstance(a, (list, tuple)):
            assert type(a) is type(b) and len(a) == len(b)
            for x, y in zip(a, b):
                same(x, y)
        else:
            assert a == b and type(a) is type(b)

    same(state, got)
    restored = torch.optim.Adam(model.parameters())
    restored.load_state_dict(got["optimizer"])
    assert restored.param_groups[0]["betas"] == (0.9, 0.99)
    with pytest.raises(ValueError, match="shorter than its layout"):
        _rebuild(layout, payload[:-1], [0])
