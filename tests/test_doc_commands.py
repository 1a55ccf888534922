"""Every command that README.md and docs/*.md show a user is run exactly as written: by this file,
by CI (.ci/run) or by `make demo`.

What counts as a shown command (``extract`` below):

- every line of a fenced code block tagged ``sh`` (a trailing backslash joins the next line; a ``#``
  after whitespace starts a comment), and every line starting with ``$ `` in a block tagged
  ``console`` (the other lines are output);
- inline code in prose that starts with a project command and has an argument (`make test-matrix`;
  a bare name such as `graphzero-dump` is a name, not a command);
- project commands: ``make``, ``torchrun``, ``accelerate launch``, ``graphzero-dump``,
  ``graphzero-compare``, ``graphzero-soak``, ``graphzero-wire-bytes``, ``python``/``python3`` with
  ``-m graphzero_tools...``, ``tools/...`` or ``examples/...``, ``bash tools/...``, a ``tools/`` or
  ``examples/`` script, each possibly after ``VAR=value`` assignments. Other commands (``pip
  install``, ``apt-get``, ``python -m venv``) install or inspect an environment and are not run by
  tests: they are not extracted.
- A fenced block with another tag or none (``text``, ``python``, ``json``, ``yaml``) must not hold a
  line that starts with a project command: a command to copy goes in an ``sh`` or ``console`` block,
  so none hides from this test.
- Recorded runs are skipped: everything from a line ``<!-- doc-commands: records -->`` to the next
  ``<!-- doc-commands: end -->`` (or to the end of the file). Such a region records commands that
  were run, with their results (benchmark passes, soak figures, CI incidents, another machine's
  output); they are not instructions and may hold placeholders (``--model gan|mlp``, ``--json
  ...``). docs/benchmarks.md's current results and docs/benchmarks-history.md (the whole file) are
  records; so are parts of docs/reliability.md and docs/inductor-unet-miscompile.md.

How each shown command is run (``COMMANDS``; every shown command must be a key and every key must
be shown, so a new documented command fails the default suite until it is added here):

- ``short``: run here, in the default suite;
- ``full``: run here under ``GRAPHZERO_DOC_COMMANDS=full`` (``make test-docs``): the examples under
  torchrun and ``accelerate launch``, ``make demo`` and the dump commands that read its
  ``demo_dump``, graphzero-compare runs, the UNet repro (each minutes on 2 CPU cores);
- ``ci``: a line of .ci/run (``make test``, ``make test-torch TORCH=2.15.0``);
- ``make test``: a prerequisite of the ``test`` target (``make lint``, ``make install``);
- ``demo``: a line of ``make demo``'s recipe (``graphzero-dump demo_dump``);
- ``suite``: a Makefile target whose recipe runs pytest (``make test-matrix``, ``make test-parity``,
  ``make test-docs``, ``make test-torch TORCH=...``): the command is itself a test run. This file
  checks that the target exists and that its recipe is a pytest run; it does not start pytest from
  inside pytest.

``short`` and ``full`` commands run in the repository root through ``bash -c`` with this venv's
bin/ first on PATH (as in an activated venv) and without the ``DS_ACCELERATOR`` the suite's
conftest sets (the examples and tools set it themselves where there is no CUDA). The default suite
checks the extraction without starting any process, then runs the short commands.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FULL = os.environ.get("GRAPHZERO_DOC_COMMANDS") == "full"
RECORDS, END = "<!-- doc-commands: records -->", "<!-- doc-commands: end -->"
COMMAND_TAGS = {"sh", "console"}


@dataclass(frozen=True)
class Run:
    """How a shown command is run. ``expect_rc``: its exit status (a callable for one that depends
    on the installed torch); ``expect``: text its output holds; ``needs_demo``: reads demo_dump."""

    how: str
    expect_rc: object = 0
    expect: str = ""
    needs_demo: bool = False
    timeout: int = 900


def unet_repro_rc() -> int:
    """The UNet repro's exit status on this torch with inductor's default config: 1 (miscompiled)
    where graphzero guards its own graphs (docs/inductor-unet-miscompile.md), else 0."""
    from graphzero.inductor_guards import backward_patches

    return 1 if backward_patches() else 0


COMMANDS: dict[str, Run] = {
    # README.md, docs/development.md, docs/usage.md: the make targets
    "make demo": Run("full", expect="graph g0"),
    "make test": Run("ci"),
    "make lint": Run("make test"),
    "make install": Run("make test"),
    "make test-torch TORCH=2.15.0": Run("ci"),
    "make test-torch TORCH=2.14.1": Run("suite"),
    "make test-full": Run("suite"),
    "make test-matrix": Run("suite"),
    "make test-parity": Run("suite"),
    "make test-docs": Run("suite"),
    # README.md, docs/examples.md: the examples under their launchers
    "accelerate launch --config_file examples/accelerate_configs/zero2.yaml examples/diffusers_text_encoder.py":
        Run("full", expect="loss"),
    "accelerate launch --config_file examples/accelerate_configs/zero2_zero1.yaml "
    "examples/diffusers_text_encoder.py --text-encoder-zero-stage 1": Run("full", expect="text encoder ZeRO-1"),
    "accelerate launch --config_file examples/accelerate_configs/zero3.yaml examples/diffusers_text_encoder.py":
        Run("full", expect="UNet ZeRO-3"),
    "torchrun --nproc_per_node 2 examples/diffusers_text_encoder.py --bf16": Run("full", expect="bf16"),
    "accelerate launch --config_file examples/accelerate_zero2.yaml examples/accelerate_gan.py": Run("full"),
    "accelerate launch --config_file examples/accelerate_zero2.yaml examples/accelerate_gan.py --disc-zero-stage 1":
        Run("full", expect="disc ZeRO-1"),
    "torchrun --nproc_per_node 2 examples/rlhf_ppo.py": Run("full"),
    "torchrun --nproc_per_node 2 examples/rlhf_ppo.py --zero-stage 2 --lora": Run("full"),
    "graphzero-dump run -n 2 examples/rlhf_ppo.py --steps 1": Run("full", expect="1 graph(s), graph breaks: 0"),
    "torchrun --nproc_per_node 2 examples/distill.py": Run("full", expect="reverse KL"),
    "torchrun --nproc_per_node 2 examples/distill.py --zero-stage 2 --lora": Run("full", expect="LoRA"),
    "torchrun --nproc_per_node 2 examples/distill.py --offload": Run("full", expect="parameters offloaded"),
    "accelerate launch --config_file examples/accelerate_configs/distill.yaml examples/distill.py":
        Run("full", expect="under accelerate launch"),
    # docs/usage.md: graphzero-dump on make demo's dump
    "graphzero-dump demo_dump": Run("demo"),
    "graphzero-dump demo_dump --graph g0 --pass insert_reduce_scatter --diff":
        Run("full", expect="insert_reduce_scatter", needs_demo=True, timeout=120),
    "graphzero-dump demo_dump --json": Run("full", expect='"graphs"', needs_demo=True, timeout=120),
    "graphzero-dump demo_dump --html report.html": Run("full", needs_demo=True, timeout=120),
    "graphzero-dump run -n 2 examples/gan_demo.py --steps 2": Run("full", expect="graph g0"),
    "graphzero-dump --help": Run("short", expect="usage: graphzero-dump", timeout=120),
    # docs/benchmarks.md
    "graphzero-compare --help": Run("short", expect="usage: graphzero-compare", timeout=300),
    "graphzero-compare --model mlp --stage 2": Run("full", expect="graphzero-inductor"),
    "graphzero-compare --model transformer --tiny --steps 2 --warmup 1": Run("full", expect="graphzero-inductor"),
    "torchrun --standalone --nproc-per-node 2 -m graphzero_tools.compare --model chain3 --tiny --steps 2 --warmup 1":
        Run("full", expect="graphzero-inductor"),
    # docs/inductor-unet-miscompile.md: exits 1 where the repro miscompiles (torch < 2.15)
    "DS_ACCELERATOR=cpu python tools/repro_unet_miscompile.py": Run("full", expect_rc=unet_repro_rc),
    "DS_ACCELERATOR=cpu python tools/repro_unet_miscompile.py --minimal": Run("full", expect_rc=unet_repro_rc),
    "DS_ACCELERATOR=cpu python tools/repro_unet_miscompile.py --minimal --config max_fusion_size=1":
        Run("full", expect="OK"),
}

# -------------------------------------------------------------------------------- extraction

ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=\S*$")
FENCE = re.compile(r"^\s*```(\S*)\s*$")
INLINE = re.compile(r"(?<!`)`([^`]+)`(?!`)")
TOOLS = {"make", "torchrun", "graphzero-dump", "graphzero-compare", "graphzero-soak", "graphzero-wire-bytes"}


def command_words(text: str) -> int:
    """How many leading words of ``text`` name a project command (after VAR=value assignments),
    0 when it is not one. ``python -m graphzero_tools.compare ...`` -> 3."""
    try:
        words = shlex.split(text, comments=False)
    except ValueError:
        words = text.split()
    i = 0
    while i < len(words) and ASSIGNMENT.match(words[i]):
        i += 1
    rest = words[i:]
    if not rest:
        return 0
    first, second = rest[0], rest[1] if len(rest) > 1 else ""
    project_path = ("tools/", "examples/")
    if first in TOOLS:
        n = 1
    elif first == "accelerate" and second == "launch":
        n = 2
    elif first in ("python", "python3") and second == "-m" and len(rest) > 2 and rest[2].startswith("graphzero_tools"):
        n = 3
    elif first in ("python", "python3", "bash") and second.startswith(project_path):
        n = 2
    elif first.startswith(project_path) and first.endswith((".sh", ".py")):
        n = 1
    else:
        return 0
    return i + n


def is_command(text: str) -> bool:
    return command_words(text) > 0


def normalise(text: str) -> str:
    """One command: comments stripped, whitespace collapsed."""
    text = re.sub(r"(^|\s)#.*$", "", text)
    return " ".join(text.split())


def logical_lines(block: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """(first line number, text) of each backslash-continued line."""
    out: list[tuple[int, str]] = []
    pending, start = "", 0
    for number, line in block:
        stripped = line.rstrip()
        start = start or number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        out.append((start, pending + stripped))
        pending, start = "", 0
    if pending:
        out.append((start, pending))
    return out


@dataclass
class Extracted:
    commands: dict[str, list[str]]   # command -> where it is shown ("file:line")
    problems: list[str]              # fenced non-command blocks that hold a command


def extract(paths: list[Path] = DOCS, root: Path = ROOT) -> Extracted:
    commands: dict[str, list[str]] = {}
    problems: list[str] = []
    for path in paths:
        name = path.relative_to(root).as_posix()
        in_records = False
        fence: str | None = None      # the open block's tag ("" when untagged)
        block: list[tuple[int, str]] = []
        prose: list[tuple[int, str]] = []   # the current paragraph outside blocks and records
        for number, line in enumerate(path.read_text().splitlines() + [""], 1):
            match = FENCE.match(line)
            if fence is None and (line.strip() in (RECORDS, END) or match or not line.strip()):
                read_prose(name, prose, commands)
                prose = []
            if fence is None and line.strip() in (RECORDS, END):
                in_records = line.strip() == RECORDS
            elif fence is None and match:
                fence, block = match.group(1), []
            elif fence is not None and line.strip() == "```":
                if not in_records:
                    read_block(name, fence, block, commands, problems)
                fence = None
            elif fence is not None:
                block.append((number, line))
            elif not in_records and line.strip():
                prose.append((number, line))
        read_prose(name, prose, commands)
    return Extracted(commands, problems)


def read_prose(name: str, paragraph: list[tuple[int, str]], commands: dict) -> None:
    """Inline code spans of one paragraph (a span may wrap onto the next line)."""
    if not paragraph:
        return
    text = "\n".join(line for _, line in paragraph)
    for match in INLINE.finditer(text):
        span = " ".join(match.group(1).split())
        words = command_words(span)
        if words and len(span.split()) > words:
            number = paragraph[0][0] + text.count("\n", 0, match.start())
            commands.setdefault(normalise(span), []).append(f"{name}:{number}")


def read_block(name: str, tag: str, block: list[tuple[int, str]], commands: dict, problems: list) -> None:
    if tag == "sh":
        for number, text in logical_lines(block):
            command = normalise(text)
            if command:
                commands.setdefault(command, []).append(f"{name}:{number}")
        return
    if tag == "console":
        for number, line in block:
            if line.startswith("$ "):
                commands.setdefault(normalise(line[2:]), []).append(f"{name}:{number}")
        return
    for number, line in block:
        if is_command(line.strip()):
            problems.append(f"{name}:{number}: a command in a ```{tag or '(untagged)'} block: "
                            f"{line.strip()!r} (use ```sh or ```console, or mark it as a record)")


# -------------------------------------------------------------------------------- the Makefile


def makefile_targets() -> dict[str, tuple[list[str], str]]:
    """target -> (prerequisites, recipe: its lines, continuation lines included)."""
    targets: dict[str, tuple[list[str], str]] = {}
    current = None
    for line in (ROOT / "Makefile").read_text().splitlines():
        if line.startswith("\t"):
            if current is not None:
                prereqs, recipe = targets[current]
                targets[current] = (prereqs, recipe + line.strip() + "\n")
            continue
        match = re.match(r"^([A-Za-z0-9_.$()/-]+):(?!=)\s*(.*)$", line)
        if match and not line.startswith("."):
            current = match.group(1)
            targets[current] = (match.group(2).split(), "")
        elif line.strip():
            current = None   # a variable or a comment: the recipe above has ended
    return targets


def make_target(command: str) -> str:
    words = command.split()
    assert words[0] == "make", command
    targets = [w for w in words[1:] if "=" not in w]
    assert len(targets) == 1, f"{command}: one target expected"
    return targets[0]


def demo_recipe() -> list[str]:
    """make demo's recipe lines as a user would type them (the venv's bin/ on PATH)."""
    _, recipe = makefile_targets()["demo"]
    out = []
    for line in recipe.splitlines():
        line = line.replace("$(VENV)/bin/", "").replace("$(DEMO_DUMP)", "demo_dump")
        out.append(" ".join(line.split()))
    return out


# -------------------------------------------------------------------------------- the checks


def test_every_documented_command_is_run() -> None:
    """The extraction equals COMMANDS: a new documented command fails here until a test, CI or
    make demo runs it (and is listed), and a command that left the docs leaves COMMANDS."""
    found = extract()
    assert not found.problems, "\n".join(found.problems)
    shown = set(found.commands)
    missing = sorted(shown - set(COMMANDS))
    assert not missing, "documented but not run by any test, CI or make demo:\n" + "\n".join(
        f"  {c!r} ({', '.join(found.commands[c])})" for c in missing)
    stale = sorted(set(COMMANDS) - shown)
    assert not stale, f"in COMMANDS but no longer documented: {stale}"


def test_the_readme_shows_few_commands() -> None:
    """The README is for a new user: the two make commands first, then a handful."""
    readme = extract([ROOT / "README.md"]).commands
    assert len(readme) <= 6, sorted(readme)
    first_block = (ROOT / "README.md").read_text().split("```")[1]
    assert first_block.startswith("sh\nmake demo") and "make test" in first_block


def test_the_extractor_follows_its_rules(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    lines = [
        "Run `make test-matrix`; `graphzero-dump` is a name; `pip install x` is not ours.",
        "```sh",
        "graphzero-compare --model mlp \\",
        "    --stage 2      # a comment",
        "```",
        "```console",
        "$ graphzero-dump d",
        "graphzero-dump output line",
        "```",
        "```text",
        "torchrun --nproc-per-node 2 examples/x.py",
        "```",
        RECORDS,
        "`make never-run` and",
        "```sh",
        "graphzero-compare --model gan|mlp --json ...",
        "```",
        END,
        "`DS_ACCELERATOR=cpu python tools/x.py --minimal`",
        "```python",
        "import graphzero",
        "```",
        RECORDS,
        "`make to-the-end`",
    ]
    doc.write_text("\n".join(lines))
    found = extract([doc], root=tmp_path)
    assert set(found.commands) == {"make test-matrix", "graphzero-compare --model mlp --stage 2",
                                   "graphzero-dump d", "DS_ACCELERATOR=cpu python tools/x.py --minimal"}
    assert len(found.problems) == 1 and "torchrun" in found.problems[0]


@pytest.mark.parametrize("command", sorted(c for c, r in COMMANDS.items() if r.how == "ci"))
def test_ci_runs(command: str) -> None:
    lines = [" ".join(line.split()) for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert command in lines, f".ci/run does not run {command!r}"


@pytest.mark.parametrize("command", sorted(c for c, r in COMMANDS.items() if r.how == "make test"))
def test_make_test_runs(command: str) -> None:
    prereqs, _ = makefile_targets()["test"]
    assert make_target(command) in prereqs, f"`make test` does not run {command!r}"


@pytest.mark.parametrize("command", sorted(c for c, r in COMMANDS.items() if r.how == "demo"))
def test_make_demo_runs(command: str) -> None:
    assert command in demo_recipe(), f"make demo's recipe {demo_recipe()} does not run {command!r}"


@pytest.mark.parametrize("command", sorted(c for c, r in COMMANDS.items() if r.how == "suite"))
def test_suite_targets_run_pytest(command: str) -> None:
    targets = makefile_targets()
    target = make_target(command)
    assert target in targets, f"{command!r}: no Makefile target {target}"
    assert "pytest" in targets[target][1], f"{command!r}: the recipe of {target} is not a pytest run"


def test_make_test_docs_runs_this_file_in_full() -> None:
    _, recipe = makefile_targets()["test-docs"]
    assert "GRAPHZERO_DOC_COMMANDS=full" in recipe and "tests/test_doc_commands.py" in recipe


# -------------------------------------------------------------------------------- running them


def run_as_written(command: str, timeout: int) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def check(command: str, spec: Run, result: subprocess.CompletedProcess[str]) -> None:
    want = spec.expect_rc() if callable(spec.expect_rc) else spec.expect_rc
    output = result.stdout + result.stderr
    assert result.returncode == want, (f"{command!r} exited {result.returncode}, expected {want}:\n"
                                       f"{output[-6000:]}")
    assert spec.expect in output, f"{command!r}: {spec.expect!r} not in its output:\n{output[-6000:]}"


@pytest.mark.parametrize("command", sorted(c for c, r in COMMANDS.items() if r.how == "short"))
def test_short_commands(command: str) -> None:
    spec = COMMANDS[command]
    check(command, spec, run_as_written(command, spec.timeout))


_DEMO: dict[str, subprocess.CompletedProcess[str]] = {}


def made_demo() -> subprocess.CompletedProcess[str]:
    """`make demo`, once per session: the dump commands read the demo_dump it writes."""
    if "demo" not in _DEMO:
        _DEMO["demo"] = run_as_written("make demo", COMMANDS["make demo"].timeout)
    return _DEMO["demo"]


FULL_COMMANDS = [c for c, r in COMMANDS.items() if r.how == "full"]   # documented order: make demo first


def short_id(command: str) -> str:
    """A test id under pytest's 100 characters (longer ids become "commandN")."""
    for part in ("--config_file ", "examples/accelerate_configs/", "examples/", "--standalone ",
                 "--nproc-per-node 2 ", "--nproc_per_node 2 "):
        command = command.replace(part, "")
    return command


@pytest.mark.skipif(not FULL, reason="GRAPHZERO_DOC_COMMANDS=full (make test-docs): minutes per command")
@pytest.mark.timeout(1000)
@pytest.mark.parametrize("command", FULL_COMMANDS, ids=[short_id(c) for c in FULL_COMMANDS])
def test_full_commands(command: str) -> None:
    spec = COMMANDS[command]
    if command == "make demo":
        check(command, spec, made_demo())
        return
    if spec.needs_demo:
        assert made_demo().returncode == 0, "make demo failed: no demo_dump to read"
    try:
        result = run_as_written(command, spec.timeout)
        check(command, spec, result)
        if command.endswith("--json"):
            json.loads(result.stdout)
        if "--html report.html" in command:
            assert (ROOT / "report.html").stat().st_size > 0
    finally:
        (ROOT / "report.html").unlink(missing_ok=True)
