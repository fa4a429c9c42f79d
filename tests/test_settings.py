"""Every run key is declared once: one ``setting(...)`` call states its default, and nothing else does.

Read from the source (as ``grep`` would): the declarations are counted call by call, and a class field or
module constant that mirrors a key under its own name with a literal default of its own is refused —
such a value names the declaration instead (``TaskKeys.shot_ways``) or takes no default at all.
"""

from __future__ import annotations

import ast
from collections import Counter

from pollen.app.registry import METHODS, all_keys
from pollen.settings import COMMON, RunConfig, declared_keys, field_keys
from tests.conftest import PROJECT_ROOT

PACKAGE = PROJECT_ROOT / "pollen"


def _sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def _setting_calls() -> Counter:
    """How many ``setting("<key>", default, ...)`` calls name each key, over the whole package."""
    found: Counter = Counter()
    for _, tree in _sources():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "setting"
                    and node.args and isinstance(node.args[0], ast.Constant) and len(node.args) > 1):
                found[node.args[0].value] += 1
    return found


def test_each_run_key_default_is_stated_by_exactly_one_setting_call():
    calls = _setting_calls()
    keys = all_keys()
    twice = sorted(k for k, n in calls.items() if n > 1)
    assert not twice, f"run keys declared more than once: {twice}"
    assert set(calls) == set(keys), (sorted(set(keys) - set(calls)), sorted(set(calls) - set(keys)))


def _names_of(key: str) -> set[str]:
    """The names code may give a key's value: the key's field name, and without its family prefix."""
    snake = key.replace("-", "_")
    prefix = snake.split("_", 1)
    return {snake, prefix[1]} if key.startswith(("proto-", "fccl-", "glfc-")) and len(prefix) == 2 else {snake}


# Fields that share a key's name but are not its value (so they may have a default of their own).
NOT_A_KEY = {
    ("pollen/app/method_spec.py", "leak_audit"): "whether a method's clients implement the audit, not the key",
    ("pollen/models/spec.py", "image_size"): "a model's input side (the key's 0 means: detect from the data)",
    ("pollen/strategies/proxy.py", "lr"): "torch's L-BFGS step size of one inversion (DLG's), not local SGD's",
    ("pollen/strategies/proxy.py", "task"): "the index of the task a proxy state was kept for",
}


def test_no_value_elsewhere_repeats_a_key_default_as_a_literal():
    """A dataclass field or ``DEFAULT_*`` constant outside the declarations that carries a key's value under
    the key's name (``shots``, ``memory_size``, ``max_update_norm``) has no literal default of its own.
    (Parameter defaults of the library's functions, e.g. a strategy's constructor, are the library's API:
    documented with the function, not read by a run.)"""
    by_name: dict[str, str] = {}
    for key in all_keys():
        for name in _names_of(key):
            by_name.setdefault(name, key)
    # A value in the run's options that shares a key's name: TaskOptions' shot keys are named in full.
    by_name.update({"ways": "shot-ways", "shots": "shot-shots", "stdev": "shot-stdev",
                    "test_per_class": "shot-test-per-class", "duplicate": "glfc-duplicate-data",
                    "num_tasks": "glfc-tasks"})
    offenders = []
    for path, tree in _sources():
        rel = path.relative_to(PROJECT_ROOT)
        if rel.parts[1] == "settings":
            continue
        for node in ast.walk(tree):
            body = node.body if isinstance(node, (ast.ClassDef, ast.Module)) else []
            for stmt in body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    name, value = stmt.target.id, stmt.value
                elif (isinstance(node, ast.Module) and isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                      and isinstance(stmt.targets[0], ast.Name) and stmt.targets[0].id.startswith("DEFAULT_")):
                    name, value = stmt.targets[0].id.lower().removeprefix("default_"), stmt.value
                else:
                    continue
                literal = isinstance(value, ast.Constant) or (
                    isinstance(value, ast.UnaryOp) and isinstance(value.operand, ast.Constant))
                if (name in by_name and literal and not (isinstance(value, ast.Constant) and value.value is None)
                        and (str(rel), name) not in NOT_A_KEY):
                    offenders.append(f"{rel}:{stmt.lineno} {name} = {ast.unparse(value)} (run key {by_name[name]})")
    assert not offenders, "\n".join(offenders)


def test_the_values_built_from_a_run_config_default_to_the_declarations():
    """Where a narrow value keeps defaults (for callers that build it by hand), they are the declared ones."""
    from pollen.datasets.spec import TaskOptions
    from pollen.protocol.screening import PayloadBounds
    from pollen.strategies.aggregation import DEFAULT_TRIM_FRACTION

    declared = {key: spec.default for key, spec in COMMON.items()}
    opts = TaskOptions()
    assert (opts.dirichlet_alpha, opts.ways, opts.shots, opts.stdev, opts.test_per_class, opts.shot_split,
            opts.max_train_samples, opts.test_fraction, opts.image_size, opts.image_channels, opts.data_split) == (
        declared["dirichlet-alpha"], declared["shot-ways"], declared["shot-shots"], declared["shot-stdev"],
        declared["shot-test-per-class"], declared["shot-split"], declared["max-train-samples"],
        declared["test-fraction"], declared["image-size"], declared["image-channels"], declared["data-split"])
    bounds = PayloadBounds()
    assert (bounds.max_update_norm, bounds.max_logit_abs, bounds.max_grad_norm, DEFAULT_TRIM_FRACTION) == (
        declared["max-update-norm"], declared["max-logit-abs"], declared["max-grad-norm"], declared["trim-fraction"])


def test_the_common_keys_are_the_sections_and_the_run_config_their_union():
    sections = [declared_keys(cls) for cls in RunConfig.__mro__[1:] if hasattr(cls, "TITLE")]
    union = {k: v for keys in sections for k, v in keys.items()}
    assert sum(len(keys) for keys in sections) == len(union) == len(COMMON)
    assert union == COMMON and set(field_keys(RunConfig).values()) == set(COMMON)
    assert set(all_keys()) == set(COMMON) | {k for spec in METHODS.values() for k in spec.keys}


def test_the_checker_finds_a_second_default(tmp_path, monkeypatch):
    """The source scan above can fail: a copy of a key's default in a class body is named."""
    fake = tmp_path / "pollen" / "datasets"
    fake.mkdir(parents=True)
    (fake / "copy.py").write_text("class Opts:\n    shots: int = 100\n    seed: int | None = None\n")
    monkeypatch.setattr(__import__(__name__), "PROJECT_ROOT", tmp_path, raising=False)
    monkeypatch.setitem(globals(), "PACKAGE", tmp_path / "pollen")
    monkeypatch.setitem(globals(), "PROJECT_ROOT", tmp_path)
    try:
        test_no_value_elsewhere_repeats_a_key_default_as_a_literal()
    except AssertionError as err:
        assert "shots = 100 (run key shot-shots)" in str(err) and "seed" not in str(err)
    else:
        raise AssertionError("a copied default went unnoticed")
