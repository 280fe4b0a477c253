"""``price(**flat)``: rlvr.costs.price from one flat set of keyword arguments, as the tests write a
run's figures; each goes to the input group (``RunShape``, ``Measured``, ``MemoryInputs``) whose
field it names, ``shape`` and ``scale_out`` as they are."""

from dataclasses import fields

from rlvr import costs


def price(*, shape=None, scale_out=costs.ScaleOut(), **flat) -> costs.Price:
    groups = {cls: {f.name for f in fields(cls)} for cls in (costs.RunShape, costs.Measured, costs.MemoryInputs)}
    unknown = set(flat) - set().union(*groups.values())
    if unknown:
        raise TypeError(f"price() got unexpected keyword arguments {sorted(unknown)}")
    part = {cls: {k: v for k, v in flat.items() if k in names} for cls, names in groups.items()}
    mem = None if shape is None else costs.MemoryInputs(shape=shape, **part[costs.MemoryInputs])
    return costs.price(costs.RunShape(**part[costs.RunShape]), costs.Measured(**part[costs.Measured]), mem, scale_out)
