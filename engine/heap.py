"""The start-up heap kept out of the cyclic garbage collector's passes."""

import gc


def freeze_startup_heap() -> None:
    """Collect once, then move every object alive now (torch, the tokenizer, the
    model's modules: about 300,000 with the default model) to the collector's
    permanent generation, as vLLM does after start-up. Call once the engine is
    built. Without it, the collector's full passes scan them all again and again
    while serving: a 99-token prompt's n-gram index took 3.1 ms to build beside
    the loaded model, 0.24 ms after the freeze. Objects created later are
    collected as usual."""
    gc.collect()
    gc.freeze()
