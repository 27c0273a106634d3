"""Incremental detokenization that never emits a broken UTF-8 character.

Byte-level tokenizers split multi-byte characters across tokens; decoding such a
prefix gives U+FFFD. We decode a short window of tokens twice (before and after
the new ones) and emit only the grown suffix, holding back while the window
ends in an incomplete character.
"""


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.read_offset = len(prompt_token_ids)
        self.prefix_offset = max(len(prompt_token_ids) - 5, 0)

    def decode_next(self, all_token_ids: list[int]) -> str:
        """Text added by the tokens past ``read_offset``; "" while incomplete."""
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        prefix = decode(all_token_ids[self.prefix_offset : self.read_offset], skip_special_tokens=skip)
        full = decode(all_token_ids[self.prefix_offset :], skip_special_tokens=skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(all_token_ids)
        return full[len(prefix) :]
