"""Forwards that smddp.smp puts on a module instance (checkpointing, offloading, the parallel
transforms), written so that copy.deepcopy(model) gives a copy that runs on its own parameters.

deepcopy copies neither functions nor closures: a closure over the module kept calling the
original's forward, or reading the original's parameters, from the copy (an EMA or teacher copy
of a transformed model silently ran the original's weights). A bound method and attributes of the
module are copied with it, and rebound to the copy."""
import types


def wrap_forward(module, slot, wrapper, context):
    """Makes `wrapper` the module's forward: a method bound to the module (an instance attribute,
    so nn.Module.__call__ and FSDP2's hooks around it still run first), which finds the forward it
    replaces, and `context`, under the module's attribute `slot` (a pair)."""
    setattr(module, slot, (module.forward, context))
    module.forward = types.MethodType(wrapper, module)


class Shared:
    """A value a deepcopy of the module keeps rather than copies: a process group, a device mesh,
    the parallel style that places the module (copies of one model share them, as its DTensor
    parameters share their mesh)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __deepcopy__(self, memo):
        return self
