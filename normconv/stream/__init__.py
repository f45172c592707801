"""The streaming room: a Hugging Face safetensors checkpoint rewritten tensor by tensor and verified block by
block, never holding the model (``swap --stream``, ``fold --stream``). Import the module you need; nothing is
re-exported here.

  checkpoint  the folder and its shards: safetensors headers, ``Checkpoint`` (one tensor at a time, keys mapped to
              the model's names), ``shard_header`` / ``ShardWriter``, ``open_folder``, ``copy_folder``
  blocks      the model built on the meta device, its blocks filled just before they run and put back after
              (``fill`` / ``restore``), several forwards meeting at every block (``lockstep``)
  writer      the output shards' layout computed up front, tensors written at their offsets with a CRC-32 each,
              read back and checked
  onepass     ``write_verified``: each block read once, rewritten in memory, run through the original and the
              rewritten model, compared and written; checksums read back; renamed into place
  swap        the exact LayerNorm -> RMSNorm swap, streamed (planned by passes.swap_norm, applied with its arithmetic)
  fold        BatchNorm folded into the layer before it, streamed (planned by passes.fold_batchnorm)

Imports run one way: checkpoint <- blocks, writer <- onepass <- swap, fold. The room sits under api / flow and over passes, graph
and io.
"""
