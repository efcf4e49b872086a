"""Megatron-LM checkpoints: ``dist`` (``torch_dist`` folders: DCP plus Megatron's metadata), ``buckets``
and ``unstack`` (its distributed optimizer's buckets and stacked layers), ``legacy`` and
``legacy_optim`` (``mp_rank_*/model_optim_rng.pt`` folders and their distributed optimizer files),
``legacy_spec`` (the stdlib spec, dims and dtypes such a folder fits)."""
