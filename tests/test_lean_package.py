"""rlvr.models.lean_llama is a package of modules behind the names the single module had: a name set
on the package (monkeypatch) acts in every module that uses it, and undoing it restores them all."""

import importlib

import pytest

import rlvr.models.lean_llama as lean

SUBMODULES = ("attention", "bf16_copies", "cache", "compiled_layers", "families", "forward", "layers", "limits",
              "modules", "packs", "products", "rope", "weight_major")


@pytest.mark.parametrize("name", ["SMALL_ATTENTION", "GROUP_ATTENTION_FLOPS", "HEAD_ROWS", "LIVE_ROWS", "linear_t",
                                  "_packed_linear", "_PACK_OK_AT", "compiled_call"])
def test_a_name_set_on_the_package_reaches_every_module_that_holds_it(monkeypatch, name):
    mods = [importlib.import_module(f"rlvr.models.lean_llama.{m}") for m in SUBMODULES]
    old = getattr(lean, name)
    holders = [m for m in mods if vars(m).get(name) is old]
    assert holders, f"no module of the package holds {name}"
    new = object()
    monkeypatch.setattr(lean, name, new)
    assert getattr(lean, name) is new and all(vars(m)[name] is new for m in holders)
    monkeypatch.undo()
    assert getattr(lean, name) is old and all(vars(m)[name] is old for m in holders)


def test_the_forward_module_does_not_reach_into_the_cpu_kernels():
    """A reader of the forward meets layers and attention, not oneDNN packs or bf16 copies' stores."""
    import rlvr.models.lean_llama.forward as fwd

    src = open(fwd.__file__).read()
    for word in ("mkldnn", "_pack", "_KEPT", "_Copies", "_stacked_linear"):
        assert word not in src
