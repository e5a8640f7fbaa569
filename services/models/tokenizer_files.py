"""Loading a model folder's tokenizer without what it does not need.

``AutoTokenizer.from_pretrained`` also loads the model's configuration class, and with it much of
transformers' model machinery (activations, weight-conversion mappings, torch.distributed's tensor
package): ~5.8 s of CPU per load on the 2-core VM, against ~1.9 s for the tokenizer class itself.
Every engine worker, the tokenizer service and the draft service load one at start, so on a host whose
engines share the cores that is most of a worker's start-up. When the folder names the generic fast
tokenizer (``tokenizer_class`` ``PreTrainedTokenizerFast`` or ``TokenizersBackend`` in
tokenizer_config.json, as SmolLM2 does) it is loaded directly; any other class goes through
AutoTokenizer, which knows its particulars.
"""

from __future__ import annotations

import json
from pathlib import Path

GENERIC_FAST = ("PreTrainedTokenizerFast", "TokenizersBackend")


def load_tokenizer(model_dir: str | Path, **kwargs):
    """The folder's Hugging Face tokenizer (local files only)."""
    folder = Path(model_dir)
    try:
        named = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        named = None
    if named in GENERIC_FAST and (folder / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True, **kwargs)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, **kwargs)
