"""DeepSpeed ZeRO checkpoints (``engine.save_checkpoint``), described for reading in place.

A checkpoint folder is a root holding ``latest`` (the tag) or the tag folder itself
(``global_step3``). What the files say, and how it becomes a spec:

* ``mp_rank_00_model_states.pt`` (ZeRO-1/2; ZeRO-3: ``zero_pp_rank_R_mp_rank_00_model_states.pt``):
  ``module`` (the state dict in training dtype; ZeRO-3 leaves empty placeholders), ``param_shapes``
  (per optimizer param group, the trainable parameters in flattening order), ``buffer_names``,
  ``shared_params`` (tied aliases), ``frozen_param_shapes`` / ``frozen_param_fragments`` (ZeRO-3),
  ``dp_world_size``, ``mp_world_size``, client state.
* ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt``: ZeRO-1/2 keep, per group, one fp32 buffer of
  the group's parameters concatenated, padded to a multiple of ``2 * dp`` and split evenly over dp
  (``single_partition_of_fp32_groups``, the Adam moments in ``base_optimizer_state``), with
  ``param_slice_mappings`` saying where each parameter's fragment lies; ZeRO-3 splits each
  parameter on its own (ceil division) and concatenates the pieces (``fp32_flat_groups``).

The generated spec says exactly that with ``flat over dp pad to multiple_of(2 * dp)`` (ZeRO-1/2)
or ``flat over dp per_param`` (ZeRO-3), one ``state ... for`` statement per param group; the
fragments DeepSpeed recorded are checked against the layout the spec lowers to. Kinds: ``param``
(the module's weights; ZeRO-3 stores none, there ``param`` is the fp32 master), ``fp32`` (the fp32
master of a bf16/fp16 ZeRO-1/2 run), ``exp_avg``, ``exp_avg_sq``, ``step`` (per group; every
parameter of the group gets it). Tied aliases are not stored twice: ``state['deepspeed']['shared_params']``
names them (loads take either name: :func:`ucl.ops.load.tied_aliases`).

Modules: ``zero`` (ZeRO-1/2/3, and the dispatch), ``pipeline`` (PipelineModule checkpoints:
``layer_NN-model_states.pt`` per layer, ``on pp = ...`` placements), ``tp`` (AutoTP
checkpoints: ``mp_rank_TT`` files per tensor-parallel rank, each parameter's split read from
DeepSpeed's own ``universal_checkpoint_info['affine_map']``), ``moe`` (``deepspeed.moe`` layers:
``layer_L_expert_E`` files, experts ``index e of N over ep``, mesh ``edp, ep``), ``mds``
(Megatron-DeepSpeed style TP: ``mp_rank_TT`` files of a model that splits itself, placed by the
pattern form of ``universal_checkpoint_info`` as ``ds_to_universal`` reads it), ``user`` (TP
checkpoints with no ``universal_checkpoint_info``, placed by the user's spec: ``ucl import --spec``),
``tp`` also holds what AutoTP, ``mds`` and ``user`` share; ``common`` (what all share). Refused
(UCL502, saying why): tensor-parallel checkpoints without ``universal_checkpoint_info`` and no user
spec, averaged or sub-param patterns ucl cannot place, parameters aligned inside the flat buffer,
MoE with tensor or pipeline parallelism, D + E rank order, AutoEP or ZeRO-3, frozen experts or
expert buffers.
"""
from .zero import describe, detect

__all__ = ["detect", "describe"]
