"""The docs state what the code does: the role table in docs/security.md is authz.ALLOWED."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from elasticpipe.security import authz, tls

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _documented_roles() -> dict[str, frozenset[str]]:
    table: dict[str, frozenset[str]] = {}
    for line in (DOCS / "security.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 or not cells[0].startswith("`") or "Service/" not in cells[0]:
            continue
        names = re.findall(r"`([^`]+)`", cells[0])
        service = names[0].split("/")[0]
        methods = [names[0].split("/")[1], *names[1:]]
        roles = re.findall(r"\b(\w+)\b", re.sub(r"\([^)]*\)", "", cells[1]))
        assert set(roles) <= set(tls.ROLES), (line, roles)
        for method in methods:
            assert f"{service}/{method}" not in table, f"{method} listed twice"
            table[f"{service}/{method}"] = frozenset(roles)
    return table


def test_the_documented_role_table_is_the_codes() -> None:
    assert _documented_roles() == authz.ALLOWED


def test_the_facade_exports_tls() -> None:
    import elasticpipe

    assert elasticpipe.TLS is tls.TLS


def test_the_sdk_reference_covers_every_argument_member_and_field() -> None:
    """docs/sdk.md names every argument of Pipeline, LocalPipeline, LocalCluster and Admin,
    every public member of the pipelines and every Admin method, every StepStats and
    StageStep field and every error class, so it cannot fall behind."""
    import dataclasses
    import inspect

    from elasticpipe import Admin, LocalCluster, LocalPipeline, Pipeline, StepStats, errors
    from elasticpipe.client.pipeline import StageStep

    text = (Path(__file__).resolve().parents[2] / "docs" / "sdk.md").read_text()
    names = {
        *list(inspect.signature(Pipeline.__init__).parameters)[1:],
        *list(inspect.signature(LocalPipeline.__init__).parameters)[1:],
        *list(inspect.signature(LocalCluster.__init__).parameters)[1:],
        *list(inspect.signature(Admin.__init__).parameters)[1:],
        *(n for n in vars(Admin) if not n.startswith("_")),
        *(n for n in dir(Pipeline) if not n.startswith("_")),
        *(n for n in dir(LocalPipeline) if not n.startswith("_")),
        *(f.name for f in dataclasses.fields(StepStats)),
        *(f.name for f in dataclasses.fields(StageStep)),
        *(
            name
            for name, cls in vars(errors).items()
            if isinstance(cls, type)
            and issubclass(cls, errors.ElasticPipeError)
            and cls not in (errors.ElasticPipeError, errors.Unavailable)
        ),
    }
    missing = sorted(n for n in names if f"`{n}`" not in text and f"`{n}(" not in text)
    assert not missing, f"docs/sdk.md does not document {missing}"


def _table_rows(lines: list[str]) -> set[tuple[str, str]]:
    """The (field, bound) rows of the fixed-width table in ``elasticpipe.security.bounds``."""
    rules = [i for i, line in enumerate(lines) if line.startswith("====")]
    rows: list[list[str]] = []
    for line in lines[rules[1] + 1 : rules[2]]:
        field, bound = line[:44].strip(), line[44:].strip()
        if not line.startswith(" "):
            rows.append([field, bound])
            continue
        rows[-1][0] += f" {field}" if field else ""
        rows[-1][1] += f" {bound}" if bound else ""
    return {(f, b) for f, b in rows}


def test_the_documented_bounds_are_the_codes() -> None:
    """docs/security.md's bounds table is the one in elasticpipe/security/bounds.py, row for row."""
    from elasticpipe.security import bounds

    text = (DOCS / "security.md").read_text()
    section = text.split("## Bounds", 1)[1].split("\n## ", 1)[0]
    documented = set()
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0] not in ("field", "---"):
            documented.add((cells[0], cells[1].strip("`")))
    assert documented == _table_rows((bounds.__doc__ or "").splitlines())


def _raises(func: object) -> list[str]:
    """The class names a docstring's ``Raises:`` section lists, in order."""
    import inspect

    doc = inspect.getdoc(func) or ""
    if "Raises:" not in doc:
        return []
    section = doc.split("Raises:", 1)[1].split("\n\n", 1)[0]
    return re.findall(r"^    (\w+):", section, flags=re.MULTILINE)


def _raised(call: Callable[[], object]) -> str:
    """The class name of what ``call()`` raises ("nothing" if it returns)."""
    try:
        call()
    except Exception as exc:
        return type(exc).__name__
    return "nothing"


def _public_callables(cls: type) -> dict[str, object]:
    return {
        name: member
        for name, member in vars(cls).items()
        if callable(member) and (not name.startswith("_") or name == "__init__")
    }


def test_help_shows_every_public_attribute_of_the_pipelines() -> None:
    """Every public attribute of a Pipeline and a LocalPipeline is in ``help()``: a
    documented member of the class (a property, like ``last_step``), or an argument of the
    same name that the constructor's docstring explains."""
    import inspect
    import pydoc

    from elasticpipe import LocalPipeline, Pipeline

    remote = Pipeline(coordinator="127.0.0.1:9", model="mlp", model_kwargs={"sizes": [4, 2]})
    local = LocalPipeline(model="mlp", model_kwargs={"sizes": [4, 2]})
    for cls, pipe in ((Pipeline, remote), (LocalPipeline, local)):
        pipe.close()
        text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
        arguments = set(inspect.signature(cls.__init__).parameters)
        for name in (n for n in vars(pipe) if not n.startswith("_")):
            assert name in arguments, f"{cls.__name__}.{name} is set in __init__ but no member"
        for name in (n for n in dir(cls) if not n.startswith("_")):
            member = inspect.getattr_static(cls, name)
            assert (inspect.getdoc(member) or "").strip(), f"{cls.__name__}.{name} undocumented"
            assert f"\n |  {name}" in text, f"help({cls.__name__}) does not show {name}"
        assert "\n |  last_step\n |      What the last ``train_step`` took" in text


def test_every_error_a_docstring_raises_exists() -> None:
    """Each class named under ``Raises:`` of a Pipeline or LocalPipeline method is one of
    elasticpipe.errors (no stale or misspelt name)."""
    from elasticpipe import LocalPipeline, Pipeline, errors

    for cls in (Pipeline, LocalPipeline):
        for name, member in _public_callables(cls).items():
            for raised in _raises(member):
                assert raised in errors.BY_REASON, f"{cls.__name__}.{name} raises {raised}?"


def test_the_documented_raises_are_what_the_methods_raise(tmp_path: Path) -> None:
    """What the methods really raise is named (by its own class, not a base) under their
    ``Raises:``: bad targets are the user's error (UserCodeError) and a wrong batch size an
    InvalidRequest, in LocalPipeline and Pipeline alike; every method of a closed pipeline
    raises PipelineClosed."""
    import torch

    from elasticpipe import LocalPipeline, Pipeline

    x = torch.randn(4, 4)
    local = LocalPipeline(model="mlp", model_kwargs={"sizes": [4, 3]}, micro_batches=2)
    cases = {
        "bad targets": (lambda: local.train_step(x, torch.tensor([0, 1, 14, 2])), "train_step"),
        "a wrong batch size": (lambda: local.train_step(x, torch.tensor([0, 1])), "train_step"),
        "bad inputs": (lambda: local.predict(torch.randn(4, 5)), "predict"),
    }
    seen: dict[str, set[str]] = {}
    for what, (call, method) in cases.items():
        name = _raised(call)
        seen.setdefault(method, set()).add(name)
        assert name in _raises(getattr(LocalPipeline, method)), (what, name)
        assert name in _raises(getattr(Pipeline, method)), (what, name)  # the same semantics
    assert seen["train_step"] == {"UserCodeError", "InvalidRequest"}

    remote = Pipeline(coordinator="127.0.0.1:9", model="mlp", model_kwargs={"sizes": [4, 3]})
    local.close()
    remote.close()
    closed = {
        remote: {
            "train_step": (x, torch.zeros(4, dtype=torch.long)),
            "predict": (x,),
            "state_dict": (),
            "save": (tmp_path / "ckpt",),
            "load": (tmp_path / "ckpt",),
            "stage_stats": (),
        },
        local: {"train_step": (x, torch.zeros(4, dtype=torch.long)), "predict": (x,)},
    }
    for pipe, calls in closed.items():
        for method, args in calls.items():
            name = _raised(lambda: getattr(pipe, method)(*args))  # noqa: B023 (called at once)
            assert name == "PipelineClosed", (type(pipe).__name__, method, name)
            assert name in _raises(getattr(type(pipe), method)), (type(pipe).__name__, method)


def _argument_doc(func: object, argument: str) -> str:
    """The text of ``argument`` under a docstring's ``Args:`` (one entry, joined)."""
    import inspect

    doc = inspect.getdoc(func) or ""
    entry = re.search(
        rf"^    {argument}: (.*?)(?=^    \w+: |^\S|\Z)", doc, re.MULTILINE | re.DOTALL
    )
    assert entry, f"no Args entry for {argument}"
    return " ".join(entry.group(1).split())


def _sdk_row(name: str) -> str:
    """The first row of a table in docs/sdk.md whose first cell is ``name``."""
    for line in (DOCS / "sdk.md").read_text().splitlines():
        if line.startswith(f"| `{name}` |"):
            return line
    raise AssertionError(f"docs/sdk.md has no row for {name}")


def test_the_loss_is_a_micro_batch_mean_in_the_docstring_and_the_reference() -> None:
    """The loss function gets one micro-batch and averages over it (each weighted by its
    share): the constructor's docstring and docs/sdk.md both say micro-batch, as the code
    computes (``training.scaled_loss``), and neither calls it a mean over the mini-batch."""
    from elasticpipe import Pipeline

    for where, text in (
        ("Pipeline.__init__", _argument_doc(Pipeline.__init__, "loss")),
        ("docs/sdk.md", _sdk_row("loss")),
    ):
        assert "mean over the micro-batch" in text, where
        assert "mean over the mini-batch" not in text, where


def test_micro_batches_say_what_a_small_batch_does() -> None:
    """docs/sdk.md and the docstring say a mini-batch of fewer samples runs one micro-batch
    per sample and that ``last_step.micro_batches`` tells how many ran."""
    from elasticpipe import Pipeline

    for text in (_argument_doc(Pipeline.__init__, "micro_batches"), _sdk_row("micro_batches")):
        assert "one micro-batch per sample" in text and "last_step.micro_batches" in text


def test_the_local_cluster_shown_in_the_reference_has_its_defaults() -> None:
    """``LocalCluster(name=value, ...)`` in docs/sdk.md shows each argument at the
    signature's default (stages=2, not another count)."""
    import ast
    import inspect

    from elasticpipe import LocalCluster

    defaults = {
        n: p.default for n, p in inspect.signature(LocalCluster.__init__).parameters.items()
    }
    shown = re.findall(r"`LocalCluster\(([^`]*)\)`", (DOCS / "sdk.md").read_text())
    assert shown, "docs/sdk.md shows no LocalCluster(...)"
    pairs = [p.split("=") for call in shown for p in call.split(", ") if "=" in p]
    assert pairs
    for name, value in pairs:
        assert ast.literal_eval(value) == defaults[name], (name, value, defaults[name])


def test_the_docs_say_pipe_step_is_the_count_committed() -> None:
    """``pipe.step`` is the number of steps committed (the next is ``pipe.step + 1``):
    no doc line says it is the step that comes next, and the reference and the property's
    docstring say committed."""
    from elasticpipe import LocalPipeline, Pipeline

    for path in [*DOCS.glob("*.md"), DOCS.parent / "README.md"]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for clause in re.split(r"[|;.]\s", line):
                if "pipe.step" in clause and "next" in clause:
                    assert "pipe.step + 1" in clause, f"{path.name}:{number}: {clause}"
    assert "committed" in _sdk_row("step")
    for cls in (Pipeline, LocalPipeline):
        assert "committed so far" in (cls.step.__doc__ or ""), cls.__name__
