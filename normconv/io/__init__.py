"""The io room: what normconv reads from the user and writes back. Import the module you need; nothing is
re-exported here.

  ledger      every file and folder a run read (real path and inode), checked by every write
  archive     zip archives (.pt2, torch.save) checked from their directory before any member is inflated
  hf_folder   what a Hugging Face folder means: the weights from_pretrained loads, every path inside the folder,
              every safetensors header valid by the library's rules
  config_size the size a Hugging Face config describes: numbers no model has refused, an estimate past memory
              counted on the meta device (transformers' own construction) before it is refused
  pickles     reading without running: weights-only torch.load, torch's and normconv's classes allowlisted, the
              globals a refused pickle would import, safetensors files
  inputs      example inputs: --input-shape, --dtype, calibration files, forward's parameters, the Hugging Face
              defaults (HF_SEQ_LEN, HF_BATCH), use_cache=False and an all-ones attention_mask where forward takes them
  hf_inputs   example inputs made from a Hugging Face config (text, pixels, audio, video, VLM image tokens)
  outputs     what is written: torch-only forms of normconv's modules, one writer per format
  dims        the dynamic dimensions of a written .onnx / .pt2: found (torch.export Dim.AUTO), named like the
              inputs, each checked at a second size (pinned where it fails)
  hf_output   a Hugging Face folder back as a folder: the original architecture carrying the rewritten weights,
              proven by from_pretrained (engine.door writes it)
  checksum    CRC-32s by ISA-L (zlib's values); the member CRC-32s of a zip torch.save wrote without them, filled in
  write       atomic writing: output paths checked before the work, temp file + rename, stale temps removed
  load        ``Loaded`` and ``load``: zoo, Hugging Face folder, .pt2, pickle, factory (+ --weights)

Imports run one way, lowest first: ledger, archive <- config_size (with time_limit); archive <- pickles <- inputs <-
hf_inputs; ledger <- hf_folder; dims <- outputs <- write (write also reads pickles and ledger); hf_output reads
kinds, nn, verify, clone only; load over all of them. graph.capture uses io.inputs, onnx.export io.write; nothing in
io imports graph, passes or anything above them.
"""
