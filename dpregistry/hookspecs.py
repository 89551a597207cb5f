"""Hook specifications: one ``dpreg_register_<kind>(register)`` per stage kind.

A plugin implements any of these and calls ``register(StageClass)`` once per stage it provides,
in the style of simonw/llm's ``register_models(register)``; a stage is registered under its own
``name``. ``register("package.module:StageClass", name="x")`` registers it lazily, imported only
when a recipe or command uses it (``name`` is then required, and must be the class's). Plugins are found through
the ``dpregistry`` entry-point group; dpregistry's own plugins load exactly the same way.
"""

import pluggy

hookspec = pluggy.HookspecMarker("dpregistry")
hookimpl = pluggy.HookimplMarker("dpregistry")


@hookspec
def dpreg_register_objectives(register):
    """Register objectives: model, per-example loss and data."""


@hookspec
def dpreg_register_samplers(register):
    """Register samplers: which records each step reads, and how that amplifies privacy."""


@hookspec
def dpreg_register_estimators(register):
    """Register estimators: per-example contributions in a coordinate space."""


@hookspec
def dpreg_register_privatizers(register):
    """Register privatizers: clip in a space, sum, add noise, report privacy events."""


@hookspec
def dpreg_register_update_rules(register):
    """Register update rules: lift a release to the parameters."""


@hookspec
def dpreg_register_accountants(register):
    """Register accountants: compose privacy events into a guarantee (and act as filters)."""


@hookspec
def dpreg_register_algorithms(register):
    """Register algorithms: named presets that fix stages and the control flow of a step."""


@hookspec
def dpreg_register_grad_samplers(register):
    """Register per-example gradients of a layer type: ``register(LayerType, handler)`` with a
    :class:`dpregistry.persample.LayerHandler` (the built-in Linear, Conv1d/2d, Embedding and
    LayerNorm handlers are registered this way). Called when per-example gradients are first needed."""
