"""No flag in the cluster kit can drift from the code.

Every ``launch_impala`` / ``launch_ppo`` / ``impala-actors`` command line in ``deploy/`` (Dockerfiles,
the Slurm template, the Kubernetes manifests, example commands in their comments) and in the code
blocks of ``docs/SCALE_OUT.md`` is extracted, its placeholders (``$VAR``, ``${VAR}``, ``$(...)``)
replaced by a dummy value (``${VAR:-default}`` by its default, ``${VAR:+word}`` by the word), and
run through the real argument parser and the config dataclasses that validate ranges, as the
entry point itself does before it starts anything.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from impala.options import ConfigError, from_flags
from impala.run.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("launch_impala", "launch_ppo", "impala-actors")
DUMMY = "1"  # a valid int, float, path, host and env id alike
# Placeholders that 1 cannot stand for: a learner group's size (a node rank must be below it)
VALUES = {"LEARNERS": "2"}
TEMPLATES = sorted(p for p in (ROOT / "deploy").rglob("*") if p.is_file()) + [ROOT / "docs" / "SCALE_OUT.md"]


# --------------------------------------------------------------------------- placeholders


def _matching(text: str, i: int, open_: str, close: str) -> int:
    """Index just past the bracket that closes the one at ``text[i]``."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == open_:
            depth += 1
        elif text[j] == close:
            depth -= 1
            if depth == 0:
                return j + 1
    raise ValueError(f"unbalanced {open_!r} in {text[i : i + 80]!r}")


def substitute(text: str) -> str:
    """Shell (and Kubernetes ``$(VAR)``) placeholders -> dummy values."""
    out, i = [], 0
    while i < len(text):
        if text[i] != "$" or i + 1 == len(text):
            out.append(text[i])
            i += 1
            continue
        nxt = text[i + 1]
        if nxt == "(":  # $(cmd), $((arithmetic)), Kubernetes $(VAR)
            i = _matching(text, i + 1, "(", ")")
            out.append(DUMMY)
        elif nxt == "{":
            end = _matching(text, i + 1, "{", "}")
            m = re.fullmatch(r"#?[A-Za-z_][A-Za-z0-9_]*(?:(:?[-=+])(.*))?", text[i + 2 : end - 1], re.S)
            if m and m.group(1) and m.group(1)[-1] in "-=":
                out.append(substitute(m.group(2)))  # ${VAR:-default}: the default
            elif m and m.group(1):
                out.append(substitute(m.group(2)))  # ${VAR:+word}: the word
            else:
                out.append(VALUES.get(text[i + 2 : end - 1], DUMMY))
            i = end
        else:
            m = re.match(r"[A-Za-z_][A-Za-z0-9_]*|[0-9@*#?$!-]", text[i + 1 :])
            if m:
                out.append(VALUES.get(m.group(0), DUMMY))
                i += 1 + m.end()
            else:
                out.append("$")
                i += 1
    return "".join(out)


# --------------------------------------------------------------------------- extraction


def split_comments(text: str) -> tuple[str, list[str]]:
    """Shell text without its comments, and the comments' bodies (a ``#`` outside quotes that starts a
    word)."""
    code, comments = [], []
    quote = None
    i = 0
    while i < len(text):
        c = text[i]
        if quote:
            if c == quote:
                quote = None
            elif c == "\\" and quote == '"':
                code.append(c)
                i += 1
                c = text[i] if i < len(text) else ""
        elif c in "'\"":
            quote = c
        elif c == "\\":
            code.append(c)
            i += 1
            c = text[i] if i < len(text) else ""
        elif c == "#" and (i == 0 or text[i - 1] in " \t\n"):
            end = text.find("\n", i)
            end = len(text) if end < 0 else end
            comments.append(text[i + 1 : end])
            i = end
            continue
        code.append(c)
        i += 1
    return "".join(code), comments


def _command_at(token: str) -> str | None:
    for name in COMMANDS:
        if token == name or token.endswith("/bin/" + name):
            return name
    return None


def shell_commands(text: str, *, examples_only: bool = False) -> list[list[str]]:
    """Each entry point's command line in shell ``text``: [name, *argv].

    ``examples_only`` (prose comments): count a name only where a flag follows it, and read from there."""
    if examples_only:
        m = re.search(r"(?<!\S)\S*(?:launch_impala|launch_ppo|impala-actors)\s+--", text)
        return shell_commands(text[m.start() :]) if m else []
    text = substitute(text.replace("\\\n", " "))
    code, comments = split_comments(text)
    lex = shlex.shlex(code, posix=True, punctuation_chars=";&|()<>\n")
    lex.whitespace, lex.commenters, lex.whitespace_split = " \t\r", "", True
    tokens = list(lex)
    found: list[list[str]] = []
    segment: list[str] = []
    for tok in [*tokens, ";"]:
        if tok and all(ch in ";&|()<>\n" for ch in tok) and not any(ch in "<>" for ch in tok):
            found.extend(_segment_commands(segment))
            segment = []
        else:
            segment.append(tok)
    for body in comments:
        found.extend(shell_commands(body, examples_only=True))
    return found


def _segment_commands(tokens: list[str]) -> list[list[str]]:
    words, skip = [], False
    for tok in tokens:  # drop redirections: `> file`, `2>&1`
        if skip:
            skip = False
            continue
        if any(ch in "<>" for ch in tok):
            if words and words[-1].isdigit() and len(words[-1]) == 1:
                words.pop()
            skip = True
            continue
        words.append(tok)
    for k, tok in enumerate(words):
        if tok in ("sh", "bash") and k + 2 < len(words) and words[k + 1] == "-c":
            return shell_commands(words[k + 2])
        name = _command_at(tok)
        if name:
            return [[name, *words[k + 1 :]]]
    return []


def yaml_commands(text: str) -> list[list[str]]:
    """Kubernetes manifests: every container's command + args (a ``sh -c`` script is shell)."""
    found = []

    def containers(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("containers", "initContainers") and isinstance(value, list):
                    yield from (c for c in value if isinstance(c, dict))
                else:
                    yield from containers(value)
        elif isinstance(node, list):
            for item in node:
                yield from containers(item)

    for doc in yaml.safe_load_all(text):
        for c in containers(doc):
            argv = [str(a) for a in (c.get("command") or []) + (c.get("args") or [])]
            if len(argv) >= 3 and argv[0] in ("sh", "bash", "/bin/sh", "/bin/bash") and argv[1] == "-c":
                found.extend(shell_commands(argv[2]))
            else:
                found.extend(shell_commands(shlex.join(argv)))
    _, comments = split_comments(text)
    for body in comments:
        found.extend(shell_commands(body, examples_only=True))
    return found


def dockerfile_commands(text: str) -> list[list[str]]:
    """RUN / CMD / ENTRYPOINT (shell or JSON form), and example commands in comments."""
    found = []
    lines = text.replace("\\\n", " ").splitlines()
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#"):
            found.extend(shell_commands(stripped[1:], examples_only=True))
            continue
        m = re.match(r"(RUN|CMD|ENTRYPOINT)\s+(.*)", stripped, re.I)
        if not m:
            continue
        body = m.group(2)
        if body.startswith("["):
            found.extend(shell_commands(shlex.join(json.loads(body))))
        else:
            found.extend(shell_commands(body))
    return found


def markdown_commands(text: str) -> list[list[str]]:
    found = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M):
        found.extend(shell_commands(block))
    return found


def commands_in(path: Path, text: str | None = None) -> list[list[str]]:
    text = path.read_text() if text is None else text
    if path.suffix == ".md":
        return markdown_commands(text)
    if path.suffix in (".yaml", ".yml"):
        return yaml_commands(text)
    if path.name.startswith("Dockerfile"):
        return dockerfile_commands(text)
    return shell_commands(text)


# --------------------------------------------------------------------------- the real parsers


def check_command(name: str, argv: list[str]) -> str | None:
    """None when ``name argv`` passes the entry point's parser and config validation; else why not."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            if name == "launch_impala":
                from learner.cli import hosts, launch_impala

                args = launch_impala.parse_args(argv)
                # a learner group's flags (--learners, --node-rank, --rdzv-endpoint) against each other; its
                # --bind names another machine's address
                hosts.requested_rank(args)
                launch_impala.resolve(args)
            elif name == "launch_ppo":
                from impala.run.ppo_config import config_from_args
                from learner.cli import launch_ppo

                args = launch_ppo.build_parser().parse_args(argv)
                config = from_flags(RunConfig, args)
                options = from_flags(launch_ppo.PPOLaunchOptions, args)
                if options.unity_build and config.env:
                    raise ConfigError("pass either --unity-build or --env, not both")
                default = str(launch_ppo.CRAWLER_CONFIG) if config.env is None else None
                config_from_args(
                    args, default_trainer_config=args.ppo__trainer_config or default, seed=config.seed
                )
            else:
                from actors import remote

                args = remote.build_parser().parse_args(argv)
                options = from_flags(remote.RemoteOptions, args)
                from_flags(RunConfig, args)
                if options.learner:
                    remote.parse_endpoint(options.learner)
    except SystemExit as e:
        if e.code == 0 and "--help" in argv:
            return None
        return err.getvalue().strip() or f"exit {e.code}"
    except (ConfigError, ValueError, OSError) as e:
        return f"{type(e).__name__}: {e}"
    return None


@pytest.fixture(autouse=True)
def _at_repo_root(monkeypatch):
    # preset paths in the templates (--config configs/..., --trainer-config configs/...) are relative to the
    # repository root, as they are to /app in the images
    monkeypatch.chdir(ROOT)


@pytest.mark.parametrize("path", TEMPLATES, ids=[str(p.relative_to(ROOT)) for p in TEMPLATES])
def test_every_command_line_in_the_kit_parses(path):
    commands = commands_in(path)
    assert commands, (
        f"{path.relative_to(ROOT)} holds no launch_impala / launch_ppo / impala-actors command line"
    )
    failures = [
        f"{shlex.join(cmd)}\n    -> {why}" for cmd in commands if (why := check_command(cmd[0], cmd[1:]))
    ]
    assert not failures, "\n".join(failures)


def test_the_kit_runs_every_entry_point():
    names = {cmd[0] for path in TEMPLATES for cmd in commands_in(path)}
    assert names == set(COMMANDS), names


def test_the_extractor_reads_shell_yaml_dockerfile_and_markdown():
    shell = r"""
PORT=${PORT:-5555}
# not a command: impala-actors learns the env from the learner
srun --het-group=1 bash -c 'exec impala-actors --learner "tcp://$0:$1" --first-id $(( 1000 * (SLURM_PROCID +
1) ))' "$H" 5555 &
"$VENV/bin/launch_impala" --env "$ENV_ID" \
    --port "${PORT:-5555}" --no-progress 2>&1 | tee log  # a comment: launch_ppo --env Pendulum-v1
x=1; launch_ppo --env Pendulum-v1 ${RESUME:+--resume} > out.txt && echo done
"""
    assert commands_in(Path("job.sbatch"), shell) == [
        ["impala-actors", "--learner", "tcp://1:1", "--first-id", "1"],
        ["launch_impala", "--env", "1", "--port", "5555", "--no-progress"],
        ["launch_ppo", "--env", "Pendulum-v1", "--resume"],
        ["launch_ppo", "--env", "Pendulum-v1"],
    ]
    manifest = """
# kubectl scale deployment/impala-actors --replicas=3
spec:
  template:
    spec:
      containers:
        - command: ["impala-actors"]
          args: ["--learner", "tcp://impala-learner:5555", "--workers", "$(N)"]
        - command: ["sh", "-c"]
          args:
            - |
              exec launch_impala --env CartPole-v1 \\
                --workers 0
"""
    assert commands_in(Path("m.yaml"), manifest) == [
        ["impala-actors", "--learner", "tcp://impala-learner:5555", "--workers", "1"],
        ["launch_impala", "--env", "CartPole-v1", "--workers", "0"],
    ]
    dockerfile = (
        "FROM x\n#   docker run img impala-actors --workers 8\nRUN pip install . && \\\n    "
        'launch_impala --help > /dev/null\nCMD ["launch_ppo", "--help"]\n'
    )
    assert commands_in(Path("Dockerfile"), dockerfile) == [
        ["impala-actors", "--workers", "8"],
        ["launch_impala", "--help"],
        ["launch_ppo", "--help"],
    ]
    markdown = "text launch_impala --nope\n```bash\nimpala-actors --curve keys --make-keys\n```\n"
    assert commands_in(Path("x.md"), markdown) == [["impala-actors", "--curve", "keys", "--make-keys"]]


def test_a_drifted_flag_or_value_fails():
    """The negative case: a flag the code does not have, or a value its config refuses, is caught,
    in each kind of file."""
    bad = {
        Path("job.sbatch"): "srun launch_impala --env CartPole-v1 --no-such-flag 3\n",
        Path(
            "m.yaml"
        ): 'spec: {containers: [{command: ["sh", "-c", "exec impala-actors --learner tcp://h:5555 --actors '
        '4"]}]}\n',
        Path("Dockerfile"): 'CMD ["launch_ppo", "--env", "Pendulum-v1", "--num-epochs", "3"]\n',
        Path("SCALE_OUT.md"): "```bash\nlaunch_impala --env CartPole-v1 --batch-size 0\n```\n",
        Path("other.sbatch"): "impala-actors --learner tcp://h:99999 --workers 2\n",
        Path("ppo.sh"): "launch_ppo --env Pendulum-v1 --unity-timeout 0\n",
    }
    for path, text in bad.items():
        commands = commands_in(path, text)
        assert len(commands) == 1, (path, commands)
        why = check_command(commands[0][0], commands[0][1:])
        assert why is not None, (path, text)
    assert "unrecognized arguments: --no-such-flag" in check_command("launch_impala", ["--no-such-flag", "3"])
    assert "--batch-size must be >= 1" in check_command(
        "launch_impala", ["--env", "CartPole-v1", "--batch-size", "0"]
    )
    assert check_command("launch_impala", ["--env", "CartPole-v1", "--batch-size", "8"]) is None


# --------------------------------------------------------------------------- Kubernetes identities


def _k8s(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((ROOT / "deploy" / "k8s" / name).read_text()) if d]


def test_actor_pods_get_disjoint_id_ranges_from_their_ordinals():
    """The actor pods' start-up script, run by sh for many pod names: each pod's ids are its own,
    stay within the wire's limit, and do not depend on the pod's address (IPv6 pods, pod networks
    wider than /16 and pods restarted elsewhere all gave colliding or changing ids before)."""
    import subprocess

    from impala.transport.wire import MAX_ACTOR_ID

    (actors,) = [d for d in _k8s("actors.yaml") if d["kind"] == "StatefulSet"]
    container = actors["spec"]["template"]["spec"]["containers"][0]
    per_pod = int(next(e["value"] for e in container["env"] if e["name"] == "ACTORS_PER_POD"))
    script = container["args"][0].replace("exec impala-actors", "echo")
    ranges = []
    for ordinal in [*range(64), 4095, 65000]:
        env = {
            "POD_NAME": f"impala-actors-{ordinal}",
            "ACTORS_PER_POD": str(per_pod),
            "PATH": "/usr/bin:/bin",
            "POD_IP": "fd00::1",
        }  # an IPv6 pod: must not matter
        out = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, check=True).stdout
        first = int(re.search(r"--first-id (\d+)", out).group(1))
        ranges.append(range(first, first + per_pod))
    ids = [i for r in ranges for i in r]
    assert len(ids) == len(set(ids)), "two pods share actor ids"
    assert max(ids) <= MAX_ACTOR_ID and min(ids) >= 1000


def test_the_learner_is_a_job_that_stays_down_once_finished():
    (learner,) = [d for d in _k8s("learner.yaml") if d["kind"] not in ("Service", "PersistentVolumeClaim")]
    assert learner["kind"] == "Job" and learner["spec"]["parallelism"] == 1
    pod = learner["spec"]["template"]
    assert pod["spec"]["restartPolicy"] == "OnFailure"  # exit 0 completes the Job; a crash restarts it
    # the Service still finds the learner's pod
    (service,) = [d for d in _k8s("learner.yaml") if d["kind"] == "Service"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()


# --------------------------------------------------------------------------- the learner group across hosts


def _group_flags(cmd: list[str]) -> dict[str, str]:
    flags = ("--learners", "--node-rank", "--rdzv-endpoint")
    return {f: cmd[cmd.index(f) + 1] for f in flags if f in cmd}


def test_slurm_starts_one_learner_rank_per_node_of_the_learner_component():
    """One srun task per learner node, each launch_impala with the group's size, its task id as node
    rank, and rank 0's node (the actors' endpoint) as the rendezvous."""
    text = (ROOT / "deploy" / "slurm" / "impala.sbatch").read_text()
    (learner,) = [c for c in commands_in(Path("impala.sbatch"), text) if c[0] == "launch_impala"]
    flags = _group_flags(learner)
    assert set(flags) == {"--learners", "--node-rank", "--rdzv-endpoint"}, learner
    raw = " ".join(text.replace("\\\n", " ").split())
    assert (
        '--learners "$LEARNERS" --node-rank "$SLURM_PROCID" --rdzv-endpoint "$LEARNER_HOST:$RDZV_PORT"' in raw
    )
    assert re.search(r"srun --het-group=0 --ntasks-per-node=1 .*launch_impala", raw)
    assert "#SBATCH --ntasks-per-node=1" in text.split("hetjob")[0]  # one rank per learner node


def test_kubernetes_runs_rank_0_behind_the_service_and_the_other_ranks_as_an_indexed_job():
    """learner.yaml's pod is node rank 0 and holds the rendezvous (its Service carries the port);
    learner-ranks.yaml's Indexed Job runs node ranks 1..N-1 (its index + 1, computed by sh for each
    index), dials rank 0 through the Service, and is not itself behind it."""
    import subprocess

    docs = _k8s("learner.yaml")
    (service,) = [d for d in docs if d["kind"] == "Service"]
    (rank0,) = [d for d in docs if d["kind"] == "Job"]
    (ranks,) = _k8s("learner-ranks.yaml")
    rank0_cmds = commands_in(ROOT / "deploy" / "k8s" / "learner.yaml")
    (learners,) = {_group_flags(c)["--learners"] for c in rank0_cmds}
    assert all(_group_flags(c)["--node-rank"] == "0" for c in rank0_cmds)
    assert 29400 in [p["port"] for p in service["spec"]["ports"]]
    assert all(c[c.index("--rdzv-endpoint") + 1].endswith(":29400") for c in rank0_cmds)
    spec = ranks["spec"]
    assert ranks["kind"] == "Job" and spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == int(learners) - 1
    labels = ranks["spec"]["template"]["metadata"]["labels"]
    assert not service["spec"]["selector"].items() <= labels.items()  # actors reach rank 0 alone
    assert service["spec"]["selector"].items() <= rank0["spec"]["template"]["metadata"]["labels"].items()
    script = ranks["spec"]["template"]["spec"]["containers"][0]["args"][0]
    (cmd,) = commands_in(ROOT / "deploy" / "k8s" / "learner-ranks.yaml")
    assert _group_flags(cmd)["--learners"] == learners
    assert _group_flags(cmd)["--rdzv-endpoint"] == f"{service['metadata']['name']}:29400"
    node_ranks = []
    for index in range(spec["completions"]):
        out = subprocess.run(
            ["sh", "-c", script.replace("exec launch_impala", "echo")],
            env={
                "JOB_COMPLETION_INDEX": str(index),
                "ENV_ID": "PongDeterministic-v4",
                "PATH": "/usr/bin:/bin",
            },
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        node_ranks.append(int(re.search(r"--node-rank (\d+)", out).group(1)))
    assert node_ranks == list(range(1, int(learners)))
