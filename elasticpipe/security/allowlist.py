"""The operator's allow-list: import a callable named ``"package.module:name"`` only from
module prefixes that every stage was started with (``--allow-models``).

It is the rule that model factories follow (``models.resolve_factory``), applied to custom
losses and optimizers: the module is imported only after its path passed the list, and the
object found must itself be defined under an allowed prefix (so an allowed module cannot hand
out, say, ``os.system`` that it happens to import).

A list is an ``AllowList``: its prefixes and how to extend it, said in the words of whoever
set it -- a stage flag on a stage, ``LocalPipeline``'s ``allow=`` argument in a local run,
where the user's own process imports the user's own code and, without ``allow=``, any
module is allowed (``LOCAL``). A plain sequence of prefixes is a stage's list.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from elasticpipe.errors import InvalidRequest, PermissionDenied

ALLOW_FLAG = "--allow-models"
STAGE_REMEDY = "start every stage with " + ALLOW_FLAG + " {package}"
LOCAL_REMEDY = "add {package!r} to LocalPipeline's allow= argument (or leave allow= out)"


@dataclass(frozen=True)
class AllowList:
    """Module prefixes a path may come from (None: any module), and the remedy a refusal
    names (``{package}``: the refused module's top package)."""

    prefixes: tuple[str, ...] | None
    remedy: str = STAGE_REMEDY

    def allows(self, module_path: str) -> bool:
        """Whether ``module_path`` is under an allowed prefix (see ``is_allowed``)."""
        return self.prefixes is None or is_allowed(module_path, self.prefixes)

    def plus(self, prefix: str) -> AllowList:
        """This list with ``prefix`` allowed too."""
        if self.prefixes is None:
            return self
        return AllowList((*self.prefixes, prefix), self.remedy)

    def refusal(self, what: str, path: str, module_path: str) -> PermissionDenied:
        """The error for ``path`` (a ``what``), whose module is under no prefix."""
        remedy = self.remedy.format(package=module_path.split(".", maxsplit=1)[0])
        return PermissionDenied(
            f"{what} {path!r} is not allowed: module {module_path!r} is under none of the "
            f"allowed prefixes {list(self.prefixes or ())!r}; to allow it, {remedy}"
        )


Allow = Sequence[str] | AllowList  # a stage's prefixes, or a list that says whose it is
LOCAL = AllowList(None, LOCAL_REMEDY)  # LocalPipeline without allow=: the user's own code


def of(allow: Allow) -> AllowList:
    """``allow`` as an ``AllowList`` (a sequence, or one string, is a stage's prefixes)."""
    if isinstance(allow, AllowList):
        return allow
    return AllowList((allow,) if isinstance(allow, str) else tuple(allow))


def is_path(name: str) -> bool:
    """Whether ``name`` is meant as ``"package.module:name"`` (it has a colon)."""
    return ":" in name


# Modules that moved when the package was regrouped by concept: a path users wrote with
# the old module ("elasticpipe.hf:causal_lm") still names the same callable.
MOVED_MODULES = {
    "elasticpipe.tls": "elasticpipe.security.tls",
    "elasticpipe.authz": "elasticpipe.security.authz",
    "elasticpipe.allowlist": "elasticpipe.security.allowlist",
    "elasticpipe.bounds": "elasticpipe.security.bounds",
    "elasticpipe.admission": "elasticpipe.security.admission",
    "elasticpipe.codec": "elasticpipe.wire.codec",
    "elasticpipe.structure": "elasticpipe.wire.structure",
    "elasticpipe.bundle": "elasticpipe.wire.bundle",
    "elasticpipe.layerwire": "elasticpipe.wire.layer_state",
    "elasticpipe.wire": "elasticpipe.wire.compress",
    "elasticpipe.job": "elasticpipe.training.job",
    "elasticpipe.schedule": "elasticpipe.training.schedule",
    "elasticpipe.training": "elasticpipe.training.objectives",
    "elasticpipe.schedulers": "elasticpipe.training.lr",
    "elasticpipe.precision": "elasticpipe.training.precision",
    "elasticpipe.loss_scaling": "elasticpipe.training.loss_scaling",
    "elasticpipe.clipping": "elasticpipe.training.clipping",
    "elasticpipe.rng": "elasticpipe.training.rng",
    "elasticpipe.models": "elasticpipe.models.contract",
    "elasticpipe.hf": "elasticpipe.models.hf",
    "elasticpipe.weights": "elasticpipe.models.weights",
    "elasticpipe.rpc": "elasticpipe.transport.rpc",
    "elasticpipe.serving": "elasticpipe.transport.serving",
    "elasticpipe.transport": "elasticpipe.transport.sending",
    "elasticpipe.bulk": "elasticpipe.transport.bulk",
    "elasticpipe.metrics": "elasticpipe.observe.metrics",
    "elasticpipe.traces": "elasticpipe.observe.traces",
    "elasticpipe.timeline": "elasticpipe.observe.timeline",
    "elasticpipe.efficiency": "elasticpipe.observe.efficiency",
    "elasticpipe.cli": "elasticpipe.cli.entry",
    "elasticpipe.admin": "elasticpipe.cli.admin",
    "elasticpipe.watch": "elasticpipe.cli.watch",
    "elasticpipe.schemas": "elasticpipe.cli.schemas",
    "elasticpipe.cluster": "elasticpipe.local.cluster",
    "elasticpipe.local": "elasticpipe.local.reference",
    "elasticpipe.demo": "elasticpipe.demo.run",
    "elasticpipe.demo_plot": "elasticpipe.demo.plot",
    "elasticpipe.demo_timeline": "elasticpipe.demo.record",
    "elasticpipe.data": "elasticpipe.demo.corpus",
}


def current_path(path: str) -> str:
    """``"elasticpipe.hf:causal_lm"`` becomes ``"elasticpipe.models.hf:causal_lm"``; any other
    path is returned as it is."""
    module_path, sep, attr = path.partition(":")
    return MOVED_MODULES.get(module_path, module_path) + sep + attr


def parse(path: str, what: str) -> tuple[str, str]:
    """Splits ``"package.module:name"``.

    Raises:
        InvalidRequest: not of that form (the message names ``path`` and ``what`` it is).
    """
    module_path, sep, attr = path.partition(":")
    if (
        not sep
        or not all(part.isidentifier() for part in module_path.split("."))
        or not attr.isidentifier()
        or attr.startswith("__")
    ):
        raise InvalidRequest(f"malformed {what} {path!r}: expected 'package.module:name'")
    return module_path, attr


def is_allowed(module_path: str, allow: Sequence[str]) -> bool:
    """``"myorg"`` allows ``"myorg"`` and ``"myorg.<anything>"``, not ``"myorgevil"``."""
    return any(module_path == p or module_path.startswith(p + ".") for p in allow if p)


def resolve(path: str, allow: Allow, what: str) -> Callable[..., Any]:
    """Imports the callable ``path`` names if the allow-list lets it.

    Args:
        path: ``"package.module:name"``.
        allow: Allowed module prefixes (an ``AllowList``: and how to allow more).
        what: What the callable is for ("loss", "optimizer"), named in errors.

    Returns:
        The callable.

    Raises:
        InvalidRequest: malformed path, failed import, missing attribute, not callable.
        PermissionDenied: the module, or the one defining the callable, is not allowed.
    """
    allowed = of(allow)
    module_path, attr = parse(current_path(path), what)
    if not allowed.allows(module_path):
        raise allowed.refusal(what, path, module_path)
    try:
        module = importlib.import_module(module_path)
    except Exception as exc:  # an allowed module's import may fail in any way
        raise InvalidRequest(
            f"cannot import module {module_path!r} of {what} {path!r}: {type(exc).__name__}: {exc}"
        ) from exc
    found = getattr(module, attr, None)
    if found is None:
        raise InvalidRequest(f"module {module_path!r} has no attribute {attr!r} ({what} {path!r})")
    if not callable(found):
        raise InvalidRequest(f"{what} {path!r} is a {type(found).__name__}, not a callable")
    inner = found
    while isinstance(inner, functools.partial):
        inner = inner.func
    defined_in = getattr(inner, "__module__", None)
    if allowed.prefixes is not None and (
        not isinstance(defined_in, str) or not allowed.allows(defined_in)
    ):
        raise PermissionDenied(
            f"{what} {path!r} is defined in module {defined_in!r}, which is under none of the "
            f"allowed prefixes {list(allowed.prefixes)!r}"
        )
    return found  # type: ignore[no-any-return]
