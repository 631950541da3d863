"""`edge-agent model import`: a model directory (`agent.model.directory`) from what users download.

The source is a `.litertlm` bundle or a folder as litert-community / Hugging Face ship one:
one or more `.tflite` exports, ``tokenizer.json`` (preferred) or ``tokenizer.model``, and
optionally ``tokenizer_config.json``, ``generation_config.json`` and ``config.json``. What
``metadata.json`` records comes from the files themselves:

* per variant: sha256 and size, and the quantization read from its weight tensors
  (`agent.model.facts`), never from its name; the context length from its KV shape;
* ``bos_id``/``eos_id``: ``tokenizer_config.json``'s ``bos_token``/``eos_token`` looked up in
  the tokenizer's vocabulary, else ``generation_config.json``'s, else ``config.json``'s ids;
  ``add_bos``: ``add_bos_token``, else whether the tokenizer's own post-processor adds BOS;
* ``stop_token_ids``: the eos id and ``generation_config.json``'s ``eos_token_id`` (an id or a
  list; ``config.json``'s when there is no generation config);
* ``chat_template``: ``tokenizer_config.json``'s (a string, or a list of named templates of
  which "default" is taken), else ``chat_template.jinja``; checked to parse as Jinja;
* ``generation``: ``temperature``/``top_k``/``top_p`` of ``generation_config.json`` (not when
  it says ``do_sample: false``: its defaults are then greedy's).

The source is only read. The directory is written into a temp directory beside the target
and renamed into place when complete, so a refusal or a crash leaves nothing half-written;
an existing target is refused unless it is an empty directory.

The package: `importer` (the one entry point, `import_model`: the temp directory, the
checks, the rename), `bundle` (what a `.litertlm` gives), `folder` (what a download folder's
side files say), `draft` (what both gather for `metadata.json`).
"""

from agent.modelimport.importer import import_model

__all__ = ["import_model"]
