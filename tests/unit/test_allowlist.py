"""Tests of the operator allow-list for losses and optimizers given by path."""

from __future__ import annotations

import pytest

from elasticpipe.errors import InvalidRequest, PermissionDenied
from elasticpipe.security import allowlist

MODELS = "tests.support.custom_models"


def test_allowed_path_resolves() -> None:
    """A callable defined in an allowed module is returned."""
    from tests.support import custom_models

    assert allowlist.resolve(f"{MODELS}:half_mse", [MODELS], "loss") is custom_models.half_mse
    assert allowlist.resolve(f"{MODELS}:half_mse", ["tests"], "loss") is custom_models.half_mse


@pytest.mark.parametrize(
    ("path", "allow", "error", "text"),
    [
        ("os:system", ["tests"], PermissionDenied, "--allow-models os"),
        (f"{MODELS}:half_mse", ["tests.supp"], PermissionDenied, "'tests.support"),
        (f"{MODELS}:half_mse", [], PermissionDenied, "none of the allowed prefixes []"),
        (f"{MODELS}:reexported_loss", [MODELS], PermissionDenied, "custom_losses"),
        (f"{MODELS}:F", [MODELS], InvalidRequest, "is a module, not a callable"),
        (f"{MODELS}:nothing", [MODELS], InvalidRequest, "no attribute 'nothing'"),
        ("tests.support.missing_mod:f", ["tests"], InvalidRequest, "cannot import"),
        ("no_such_module_xyz:f", ["tests"], PermissionDenied, "'no_such_module_xyz'"),
        ("no colon", ["tests"], InvalidRequest, "malformed loss 'no colon'"),
        ("a.b:__class__", ["a"], InvalidRequest, "malformed"),
    ],
    ids=["prefix", "not-a-prefix-of", "empty", "reexport", "module-object", "missing", "import",
         "checked-before-import", "malformed", "dunder"],
)  # fmt: skip
def test_refusals_name_the_path(
    path: str, allow: list[str], error: type[Exception], text: str
) -> None:
    """Every refusal names the path and says why; disallowed modules are never imported."""
    with pytest.raises(error) as info:
        allowlist.resolve(path, allow, "loss")
    assert text in str(info.value)


@pytest.mark.parametrize(
    ("allow", "remedy"),
    [
        (["mypkg"], "start every stage with --allow-models tests"),
        (allowlist.AllowList(("mypkg",), allowlist.LOCAL_REMEDY),
         "add 'tests' to LocalPipeline's allow= argument (or leave allow= out)"),
    ],
    ids=["stage", "local"],
)  # fmt: skip
def test_a_refusal_says_how_to_allow_the_module_where_it_is_set(
    allow: allowlist.Allow, remedy: str
) -> None:
    """A stage's list (a plain sequence) names the stage flag; LocalPipeline's names its
    ``allow=`` argument -- for losses and optimizers and for model factories alike."""
    from elasticpipe import models

    for refuse in (
        lambda: allowlist.resolve(f"{MODELS}:half_mse", allow, "loss"),
        lambda: models.resolve_factory(f"{MODELS}:tiny", allow),
    ):
        with pytest.raises(PermissionDenied) as info:
            refuse()
        assert str(info.value).count(remedy) == 1, str(info.value)


def test_the_local_list_allows_any_module_and_what_it_hands_out() -> None:
    """``LOCAL`` (LocalPipeline without ``allow=``) imports any module, and a callable an
    allowed module re-exports from another is taken too: it is the user's own process."""
    from tests.support import custom_losses, custom_models

    assert allowlist.resolve(f"{MODELS}:reexported_loss", allowlist.LOCAL, "loss") is (
        custom_losses.half_mse
    )
    assert allowlist.of(allowlist.LOCAL.plus("x")) is allowlist.LOCAL
    from elasticpipe import models

    assert models.resolve_factory(f"{MODELS}:tiny", allowlist.LOCAL) is custom_models.tiny
