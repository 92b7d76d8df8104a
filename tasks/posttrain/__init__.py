"""Post-training building blocks: what fine-tuning and distillation add on top of the shared loop.

    sources.py        a model reference (Hugging Face directory, s3:// prefix, checkpoint, models:/
                      URI) -> a local model dir
    datasets.py       SFT train/eval examples (prompt/completion or chat JSONL) and the data dir
    batches.py        SFT step batches: padded or packed examples, plus replayed pretraining rows
    packing.py        the forward pass over packed rows (positions restart, no attention across
                      examples)
    objectives.py     loss functions the loop plugs in: SFT, distillation (online or cached),
                      each with the replay term
    lora.py           low-rank adapters through peft, saved in peft's format and merged back into
                      the plain model at the end
    teacher_cache.py  the teacher's top-k logits, computed once and read by the student's job
    quantize.py       int8 dynamic quantization of a model, measured against the float one
"""
