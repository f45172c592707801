"""The io room: what normconv reads from the user and writes back. Import the module you need; nothing is
re-exported here.

  pickles     reading without running: weights-only torch.load, torch's and normconv's classes allowlisted, the
              globals a refused pickle would import, safetensors files; ``describe`` (an exception in one line)
  inputs      example inputs: --input-shape, --dtype, calibration files, forward's parameters, the Hugging Face
              defaults (HF_SEQ_LEN, HF_BATCH), use_cache=False and an all-ones attention_mask where forward takes them
  hf_inputs   example inputs made from a Hugging Face config (text, pixels, audio, video, VLM image tokens)
  outputs     what is written: torch-only forms of normconv's modules, one writer per format
  write       atomic writing: output paths checked before the work, temp file + rename, stale temps removed
  load        ``Loaded`` and ``load``: zoo, Hugging Face folder, .pt2, pickle, factory (+ --weights)

Imports run one way, lowest first: pickles <- inputs <- hf_inputs; outputs <- write (write also reads pickles);
load over all of them. graph.capture uses io.inputs, onnx.export io.write; nothing in io imports graph, passes or
anything above them.
"""
