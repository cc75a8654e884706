"""Tests of the operator allow-list for losses and optimizers given by path."""

from __future__ import annotations

import pytest

from elasticpipe.errors import InvalidRequest, PermissionDenied
from elasticpipe.security import allowlist

MODELS = "tests.integration.custom_models"


def test_allowed_path_resolves() -> None:
    """A callable defined in an allowed module is returned."""
    from tests.integration import custom_models

    assert allowlist.resolve(f"{MODELS}:half_mse", [MODELS], "loss") is custom_models.half_mse
    assert allowlist.resolve(f"{MODELS}:half_mse", ["tests"], "loss") is custom_models.half_mse


@pytest.mark.parametrize(
    ("path", "allow", "error", "text"),
    [
        ("os:system", ["tests"], PermissionDenied, "--allow-models os"),
        (f"{MODELS}:half_mse", ["tests.integ"], PermissionDenied, "'tests.integration"),
        (f"{MODELS}:half_mse", [], PermissionDenied, "none of the allowed prefixes []"),
        (f"{MODELS}:reexported_loss", [MODELS], PermissionDenied, "custom_losses"),
        (f"{MODELS}:F", [MODELS], InvalidRequest, "is a module, not a callable"),
        (f"{MODELS}:nothing", [MODELS], InvalidRequest, "no attribute 'nothing'"),
        ("tests.integration.missing_mod:f", ["tests"], InvalidRequest, "cannot import"),
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
