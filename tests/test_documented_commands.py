"""Every command printed in README.md and docs/ runs, and every relative link there resolves.

Commands are the lines of fenced ``bash``/``sh`` blocks (``\\`` continues a line, ``#`` lines are
comments). A command marked with a trailing ``# needs: <what>`` comment, or in a block whose first line
is such a comment, is skipped with that reason; so is one that names a placeholder path
(``/path/to/...``) or needs ``$POLLEN_DATA_ROOT`` when it is unset. The rest run for real, made tiny:
a launch (``pollen run``, ``pollen fleet``, ``make run``, ``make fleet``) gets its run config merged
with :data:`SMOKE` settings for its method's family (one round, a few samples), results go to a
temporary folder (which also stands for the documented ``runs/``), ``make`` never reinstalls the
venv, and the block, run as one ``bash -e`` script, must exit 0.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from pollen.launch import format_run_config, parse_run_config
from tests.conftest import PROJECT_ROOT
from tests.numerics import numeric_platform

PAGES = sorted([PROJECT_ROOT / "README.md", *(PROJECT_ROOT / "docs").rglob("*.md")])
NEEDS = re.compile(r"#\s*needs:\s*(.+?)\s*$")
FENCE = re.compile(r"^```(\w*)\s*$")

# Tiny settings per method family, merged over a documented run config (documented values lose).
SMOKE_COMMON = {"num-server-rounds": 1, "max-train-samples": 64}
SMOKE = {
    "weights": {},
    "local": {},
    "prototypes": {"shot-shots": 20, "shot-test-per-class": 5, "proto-evaluate-every": 1},
    "logits": {"model-width": 0.125, "fccl-public-size": 40, "fccl-public-batch-size": 20,
               "fccl-train-sizes": "24,24,24,24", "fccl-solo-epochs": 1, "fccl-local-epochs": "1",
               "fccl-test-size": 20, "fccl-batch-size": 12},
    "glfc": {"num-server-rounds": 2, "glfc-tasks": 2, "glfc-rounds-per-task": 1, "glfc-classes-per-task": 5,
             "glfc-initial-clients": 3, "glfc-new-clients": 1, "glfc-clients-per-round": 2,
             "glfc-max-per-class": 10, "glfc-memory-size": 10, "glfc-eval-per-class": 10,
             "glfc-proxy-iterations": 2, "glfc-proxy-keep": 1, "glfc-perturb-steps": 2, "model-width": 0.125,
             "local-epochs": 1},
}
DATA_TASKS_WITHOUT_FILES = {"uci-dirichlet", "uci-digits-cil"}
STAMP = ".venv/.pollen-installed"


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    text: str
    needs: str | None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


@dataclass(frozen=True)
class Block:
    """One fenced block: its commands run in order in one shell, as a reader would paste them.

    A block whose first comment says ``(as written)`` runs without the smoke rewriting (only ``runs/``
    moves to a scratch folder), and the paragraph after it that starts with ``It prints`` quotes, in
    backticks, lines the block's output must contain: numbers the page promises. Another kind of CPU
    computes other last bits (``tests/numerics.py``): a paragraph right after it that starts with ``On
    a `<platform>` machine`` quotes what that platform prints instead, and is what it is held to.
    """

    page: str
    line: int
    commands: tuple[Command, ...]
    needs: str | None
    as_written: bool = False
    prints: tuple[str, ...] = ()
    platform_prints: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    def promised(self, platform: str) -> tuple[str, ...]:
        """The lines this platform must print: its own quote, or the page's."""
        return dict(self.platform_prints).get(platform, self.prints)


def documented_blocks(pages=PAGES) -> list[Block]:
    out: list[Block] = []
    for page in pages:
        rel = str(page.relative_to(PROJECT_ROOT)) if page.is_relative_to(PROJECT_ROOT) else page.name
        lang, block_needs, pending, start, first, commands, opened = None, None, "", 0, False, [], 0
        as_written = False
        lines = page.read_text().splitlines()
        for number, line in enumerate(lines, 1):
            fence = FENCE.match(line.strip())
            if fence and lang is None:
                lang, block_needs, first, commands, opened = fence[1] or "text", None, True, [], number
                as_written = False
                continue
            if fence and lang is not None:
                if lang in ("bash", "sh") and commands:
                    out.append(Block(rel, opened, tuple(commands), block_needs, as_written,
                                     *(quoted_output(lines[number:]) if as_written else ((), ()))))
                lang = None
                continue
            if lang not in ("bash", "sh"):
                continue
            stripped = line.strip()
            if stripped.startswith("#"):
                if first and NEEDS.search(stripped):
                    block_needs = NEEDS.search(stripped)[1]
                if first and "(as written)" in stripped:
                    as_written = True
                first = False
                continue
            first = False
            if not stripped and not pending:
                continue
            if not pending:
                start = number
            if stripped.endswith("\\"):
                pending += stripped[:-1] + " "
                continue
            text = pending + stripped
            pending = ""
            code, comment = split_comment(text)
            needs = NEEDS.search(comment)
            commands.append(Command(rel, start, code, needs[1] if needs else None))
    return out


def quoted_output(after: list[str]) -> tuple[tuple[str, ...], tuple[tuple[str, tuple[str, ...]], ...]]:
    """The backquoted fragments of the ``It prints`` paragraph right after a block (empty if none), and
    those of each ``On a `<platform>` machine`` paragraph after it, by platform."""
    paragraphs = "\n".join(after).lstrip("\n").split("\n\n")
    if not paragraphs[0].startswith("It prints"):
        return (), ()
    own = []
    for text in paragraphs[1:]:
        if not text.startswith("On a `"):
            break
        platform, *lines = re.findall(r"`([^`]+)`", text)
        own.append((platform, tuple(lines)))
    return tuple(re.findall(r"`([^`]+)`", paragraphs[0])), tuple(own)


def split_comment(text: str) -> tuple[str, str]:
    """``cmd  # comment`` -> (``cmd``, ``# comment``): a ``#`` that starts a word outside quotes."""
    quote = None
    for i, char in enumerate(text):
        if quote:
            if char == quote:
                quote = None
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or text[i - 1].isspace()):
            return text[:i].rstrip(), text[i:]
    return text, ""


def documented_commands(pages=PAGES) -> list[Command]:
    return [c for block in documented_blocks(pages) for c in block.commands]


# --- making a documented command tiny -----------------------------------------------------------------

def _family(values: dict) -> str:
    from pollen.app.registry import METHODS

    spec = METHODS.get(values.get("method", "fedavg"))
    return spec.family if spec is not None else "weights"


def _smoke(values: dict, rounds_option: bool = False) -> dict:
    family = _family(values)
    merged = {**values, **SMOKE_COMMON, **SMOKE.get(family, {})}
    if family == "logits" and values.get("task") == "image-domains":  # trains and tests on whole folders
        merged = {k: v for k, v in merged.items() if k not in ("fccl-train-sizes", "fccl-test-size")}
    if family == "glfc" and values.get("task") == "cifar100-cil":
        merged["glfc-classes-per-task"] = 10
    if rounds_option:  # make fleet passes ROUNDS itself
        merged.pop("num-server-rounds", None)
    return merged


RUNS = re.compile(r"(?<![\w./$-])runs(?=/|\s|$)")
RUN_CONFIG_OPTION = re.compile(r"--run-config\s+\"([^\"]*)\"")
RUN_CONFIG_VAR = re.compile(r"RUN_CONFIG=\"([^\"]*)\"")


def is_launch(words: list[str]) -> bool:
    """``pollen run ...``, or the launcher's old spelling ``python -m pollen.launch.launcher ...``."""
    return words[:2] == ["pollen", "run"] or "pollen.launch.launcher" in words


def smoke_command(text: str, out_dir: Path) -> str:
    """The documented command with a tiny run config and results under ``out_dir`` (which also replaces
    the documented results folder ``runs/``). Rewritten as text, so shell variables stay as written."""
    text = RUNS.sub(str(out_dir), text)
    words = text.split()
    if is_launch(words) and "--help" not in words and "-h" not in words:
        return _smoke_launch(text, out_dir)
    if words[:2] in (["make", "run"], ["make", "fleet"]):
        return _smoke_make(text, out_dir)
    if words[:2] == ["pollen", "fleet"] and "--help" not in words and "-h" not in words:
        return _smoke_fleet(text, out_dir)
    return text


def _smoke_launch(text: str, out_dir: Path) -> str:
    text = re.sub(r"\s--out-dir\s+\S+", "", text)
    # more than a few clients only slow the smoke run down: the launcher picks what the task needs, else 5
    text = re.sub(r"\s--num-supernodes\s+(\d+)", lambda m: m[0] if int(m[1]) <= 5 else "", text)
    found = RUN_CONFIG_OPTION.search(text)
    values = parse_run_config(found[1]) if found else {}
    # a resumed run keeps its saved config (only rounds, paths and device may change) and its own folder
    resumed = "--resume" in text.split()
    smoke = values if resumed else _smoke(values)
    text = RUN_CONFIG_OPTION.sub("", text).rstrip()
    return f"{text}{'' if resumed else f' --out-dir {out_dir}'} --run-config \"{format_run_config(smoke)}\""


def _smoke_fleet(text: str, out_dir: Path) -> str:
    """``pollen fleet``: the run config made tiny as a launch's, its rounds (``--rounds``) the smoke's, results
    under ``out_dir``. The SuperNodes stay as written: ``--data-dirs`` and ``--public-dirs`` name one folder
    per node."""
    text = re.sub(r"\s--(out-dir|rounds)\s+\S+", "", text)
    found = RUN_CONFIG_OPTION.search(text)
    values = parse_run_config(found[1]) if found else {}
    method = re.search(r"\s--method\s+(\S+)", text)
    smoke = _smoke({"method": method[1], **values} if method else values)
    rounds = smoke.pop("num-server-rounds")
    if method:
        smoke.pop("method", None)  # the option names it
    text = RUN_CONFIG_OPTION.sub("", text).rstrip()
    return f"{text} --rounds {rounds} --out-dir {out_dir} --run-config \"{format_run_config(smoke)}\""


def _smoke_make(text: str, out_dir: Path) -> str:
    fleet = text.split()[1] == "fleet"
    found = RUN_CONFIG_VAR.search(text)
    values = parse_run_config(found[1]) if found else {}
    method = re.search(r"\bMETHOD=(\S+)", text)
    if method:
        values.setdefault("method", method[1])
    text = RUN_CONFIG_VAR.sub("", text)
    text = re.sub(r"\s(NUM_SUPERNODES|OUT_DIR|ROUNDS)=\S+", "", text).rstrip()
    smoke = _smoke(values, rounds_option=fleet)
    if (PROJECT_ROOT / STAMP).is_file():  # offline: never reinstall (make would when pyproject.toml is newer)
        text = re.sub(r"^make\b", f"make -o {STAMP}", text)
    if fleet:
        smoke.pop("method", None)
        text += " NUM_SUPERNODES=2 ROUNDS=1"
    return f"{text} OUT_DIR={out_dir} RUN_CONFIG=\"{format_run_config(smoke)}\""


def skip_reason(cmd: Command) -> str | None:
    if cmd.needs:
        return f"needs {cmd.needs}"
    if "/path/to/" in cmd.text:
        return "names a placeholder path (/path/to/...)"
    if not os.environ.get("POLLEN_DATA_ROOT"):
        if "pollen data sample" in cmd.text and "--data-root" not in cmd.text:
            return "samples MNIST images: needs POLLEN_DATA_ROOT"
        words = shlex.split(cmd.text)
        config = next((words[i + 1] for i, w in enumerate(words[:-1]) if w == "--run-config"), "")
        task = parse_run_config(config).get("task", "uci-dirichlet") if config else "uci-dirichlet"
        if task not in DATA_TASKS_WITHOUT_FILES:
            return f"task {task!r} needs POLLEN_DATA_ROOT"
    return None


def block_script(block: Block, out_dir: Path) -> tuple[str, list[str]]:
    """The block as one ``bash -e`` script of smoke commands (the commands themselves for an ``(as
    written)`` block), and the commands left out with why."""
    lines, left_out = ["set -euo pipefail"], []
    for cmd in block.commands:
        reason = skip_reason(cmd)
        if reason:
            left_out.append(f"{cmd.id}: {reason}")
        else:
            lines.append(RUNS.sub(str(out_dir), cmd.text) if block.as_written else smoke_command(cmd.text, out_dir))
    return "\n".join(lines), left_out


# --- tests -----------------------------------------------------------------------------------------------

BLOCKS = documented_blocks()
COMMANDS = [c for block in BLOCKS for c in block.commands]


def test_the_pages_print_commands_and_keep_the_skip_list_small():
    assert len(COMMANDS) >= 5
    skipped = [c.id for c in COMMANDS if c.needs] + [b.id for b in BLOCKS if b.needs]
    assert len(skipped) <= len(COMMANDS) // 3, skipped
    for cmd in COMMANDS:
        words = shlex.split(cmd.text)  # every command is valid shell words
        if is_launch(words) and "--run-config" in words:
            parse_run_config(words[words.index("--run-config") + 1])


def test_a_block_run_as_written_keeps_its_commands_and_its_quoted_output(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```bash\n# a run (as written)\n"
                    "pollen run --out-dir runs --run-config \"num-server-rounds=2\"\n```\n\n"
                    "It prints `round 2/2 | accuracy 0.5` and\n`accuracy: 0.25 (1/4)`.\n\n"
                    "On a `Vendor-AVX2` machine it prints `round 2/2 | accuracy 0.4` and\n`accuracy: 0.5 (2/4)`.\n\n"
                    "More text `not this`.\n")
    (block,) = documented_blocks([page])
    assert block.as_written and block.prints == ("round 2/2 | accuracy 0.5", "accuracy: 0.25 (1/4)")
    assert block.promised("Vendor-AVX2") == ("round 2/2 | accuracy 0.4", "accuracy: 0.5 (2/4)")
    assert block.promised("Other-AVX512") == block.prints
    script, _ = block_script(block, tmp_path / "out")
    assert script.splitlines()[1] == f'pollen run --out-dir {tmp_path / "out"} --run-config "num-server-rounds=2"'


def test_smoke_rewriting_keeps_the_documented_keys_and_makes_the_run_tiny(tmp_path):
    text = ("pollen run --num-supernodes 20 --run-config \"method='fedproto' task='mnist-shot' "
            "shot-ways=3 num-server-rounds=100\"")
    words = shlex.split(smoke_command(text, tmp_path))
    assert "--num-supernodes" not in words and words[words.index("--out-dir") + 1] == str(tmp_path)
    values = parse_run_config(words[words.index("--run-config") + 1])
    assert values["method"] == "fedproto" and values["shot-ways"] == 3 and values["num-server-rounds"] == 1
    words = shlex.split(smoke_command("make fleet METHOD=fedprox ROUNDS=2 RUN_CONFIG=\"local-epochs=1\"", tmp_path))
    assert "METHOD=fedprox" in words
    assert "ROUNDS=1" in words and "NUM_SUPERNODES=2" in words
    assert "num-server-rounds" not in next(w for w in words if w.startswith("RUN_CONFIG="))
    fleet = ("pollen fleet --method fccl --num-supernodes 3 --rounds 2 --data-dirs a,b,c "
             "--run-config \"task='image-domains' fccl-public-size=200\" --out-dir runs --quiet")
    words = shlex.split(smoke_command(fleet, tmp_path))
    assert words[:9] == ["pollen", "fleet", "--method", "fccl", "--num-supernodes", "3", "--data-dirs", "a,b,c",
                         "--quiet"]
    assert words.count("--rounds") == 1 and words[words.index("--rounds") + 1] == "1"
    assert words.count("--out-dir") == 1 and words[words.index("--out-dir") + 1] == str(tmp_path)
    values = parse_run_config(words[words.index("--run-config") + 1])
    assert values["task"] == "image-domains" and values["fccl-public-size"] == 40 and values["fccl-solo-epochs"] == 1
    assert "method" not in values and "num-server-rounds" not in values  # options carry them
    assert smoke_command("ls runs/*/summary.json", tmp_path) == f"ls {tmp_path}/*/summary.json"
    assert split_comment("make run   # FedAvg, 5 clients") == ("make run", "# FedAvg, 5 clients")
    assert split_comment("x --run-config \"a='#b'\" # needs: gpu") == ("x --run-config \"a='#b'\"", "# needs: gpu")
    assert split_comment('echo "$#"') == ('echo "$#"', "")
    old_spelling = smoke_command("python -m pollen.launch.launcher --run-config \"method='fedavg'\"", tmp_path)
    assert f"--out-dir {tmp_path}" in old_spelling and "num-server-rounds=1" in old_spelling
    resumed = smoke_command('pollen run --resume "$RUN" --run-config "num-server-rounds=3"', tmp_path)
    assert '--resume "$RUN"' in resumed and resumed.endswith('--run-config "num-server-rounds=3"')


# Identical blocks (a method page repeating README's) run once.
UNIQUE = list({tuple(c.text for c in b.commands): b for b in BLOCKS}.values())


@pytest.mark.e2e
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("block", UNIQUE, ids=[b.id for b in UNIQUE])
def test_documented_commands_run(block, tmp_path):
    if block.needs:
        pytest.skip(f"needs {block.needs}")
    script, left_out = block_script(block, tmp_path / "runs")
    if script.count("\n") == 0 or any("POLLEN_DATA_ROOT" in why for why in left_out):
        pytest.skip("; ".join(left_out))  # the block's other commands build on what the missing data gives
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "POLLEN_OUT_DIR": str(tmp_path / "runs"), "OUT_DIR": str(tmp_path / "runs"),
           "FLWR_HOME": str(tmp_path / "flwr-home")}
    proc = subprocess.run(["bash", "-c", script], cwd=PROJECT_ROOT, env=env, capture_output=True, text=True,
                          timeout=1700)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, f"{block.id} exited {proc.returncode}:\n{script}\n---\n{tail}"
    missing = [line for line in block.promised(numeric_platform()) if line not in proc.stdout]
    assert not missing, f"{block.id} promises output it did not print: {missing}\n---\n{proc.stdout[-4000:]}"


# --- links -----------------------------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    out = set()
    for heading in re.findall(r"^#+\s+(.+?)\s*$", text, flags=re.M):
        out.add(re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-"))
    return out


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue
            name, _, anchor = target.partition("#")
            path = (page.parent / name).resolve() if name else page
            if not path.exists():
                broken.append(f"{page.relative_to(PROJECT_ROOT)}: {target}")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{page.relative_to(PROJECT_ROOT)}: {target} (no such heading)")
    assert not broken, broken
