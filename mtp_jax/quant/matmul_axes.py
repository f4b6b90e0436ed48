"""How the products read each matmul weight, declared where its module creates it, beside its logical axes:

    self.o_proj = nnx.Param(o, axes=("heads", "head_dim", "embed"), matmul=MatmulAxes((0, 1)))  # NHD

`MatmulAxes` (under `MATMUL_KEY` in the variable's metadata) counts over the weight's own axes, as `axes=` does;
`param_matmul` reads it back over the whole array, each leading stacked-layer axis (`sharding.param_axes`'s
`layers`) batched. What a format stores quantized, and along which axes, follows from it alone (`formats`): a
parameter that declares none stays as it is (norms, biases, routers, the DeltaNet convolution and decay parameters,
the shared expert's gate vector).
"""

from __future__ import annotations

import dataclasses

from flax import nnx

from mtp_jax.parallel.sharding import param_axes

MATMUL_KEY = "matmul"  # the metadata key: nnx.Param(value, axes=(...), matmul=MatmulAxes(...))


@dataclasses.dataclass(frozen=True)
class MatmulAxes:
    """How products read a weight, over its own axes: `contracting`, the axes they sum over (a format's scales keep
    every other axis: one scale per output channel, or blocks along the contracting axes); `batched`, axes that
    index matrices (routed experts [E, in, out]: (0,)), which no block crosses; `vocabulary`, an embedding [V, D] or
    lm_head [D, V], also read a row or column at a time (`take_rows`, `take_columns`), stored only by formats that
    name a format for it (`WeightFormat.vocabulary`); `split_reads`, read in parts along an output axis, each part in
    a product of its own (latent attention's kv_b: `block_parts`), so its scales stay in blocks before the loop
    (`loop_weights.spread_scales_shape`)."""

    contracting: tuple[int, ...]
    batched: tuple[int, ...] = ()
    vocabulary: bool = False
    split_reads: bool = False

    def stacked(self, lead: int) -> MatmulAxes:
        """These axes on the array that stacks the weight under `lead` leading axes, which are batched."""
        shift = lambda axes: tuple(lead + axis for axis in axes)
        return dataclasses.replace(
            self, contracting=shift(self.contracting), batched=tuple(range(lead)) + shift(self.batched)
        )


def param_matmul(variable, name: str) -> MatmulAxes | None:
    """The `MatmulAxes` an nnx variable (`name`: its path, for `param_axes`' error) declared, over its whole array
    (each leading stacked-layer axis batched); None where it declared none."""
    declared = variable.get_metadata().get(MATMUL_KEY)
    return None if declared is None else declared.stacked(param_axes(variable, name).count("layers"))


def param_matmuls(module) -> dict[tuple[str, ...], MatmulAxes]:
    """`param_matmul` of every variable of `module` (an nnx module, abstract or not) that declares one, by state
    path."""
    flat = ((tuple(map(str, path)), variable) for path, variable in nnx.to_flat_state(nnx.state(module)))
    matmuls = {path: param_matmul(variable, "/".join(path)) for path, variable in flat}
    return {path: matmul for path, matmul in matmuls.items() if matmul is not None}
