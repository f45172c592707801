"""The streaming room: a Hugging Face safetensors checkpoint rewritten tensor by tensor and verified block by
block, never holding the model (``swap --stream``, ``fold --stream``). Import the module you need; nothing is
re-exported here.

  checkpoint  the folder and its shards: safetensors headers, ``Checkpoint`` (one tensor at a time, keys mapped to
              the model's names), ``ShardWriter`` / ``write_shards``, ``open_folder``, ``copy_folder``
  blocks      the model built on the meta device, its blocks loaded from the checkpoint on demand (``OnDemand``),
              and ``write_verified``: rewrite into a temp folder, verify block by block, rename into place
  swap        the exact LayerNorm -> RMSNorm swap, streamed (planned by passes.swap_norm, applied with its arithmetic)
  fold        BatchNorm folded into the layer before it, streamed (planned by passes.fold_batchnorm)

Imports run one way: checkpoint <- blocks <- swap, fold. The room sits under api / flow and over passes, graph
and io.
"""
