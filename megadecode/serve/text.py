"""From generated tokens to the text a client sees: incremental detokenization and stop strings.

Detokenization decodes a short window of recent tokens, not the whole output, at each new token (the offsets
scheme of HF text-generation-inference and vLLM): the text of tokens [prefix, read) is already out, the text of
[prefix, end) minus it is new. Text that ends in U+FFFD (an incomplete UTF-8 sequence: a byte-level tokenizer
emits characters byte by byte) is held back until the character completes.

Stop strings (OpenAI `stop`): the text ends before the first occurrence of any of them, which is not returned.
While streaming, a tail of the text that could still grow into a stop string is held back.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tok, self.stop = tokenizer, tuple(s for s in stop if s)
        self.ids: list[int] = []
        self._prefix = self._read = 0
        self.text = ""  # all text decoded so far (stop strings cut), of which `sent` characters were returned
        self.sent = 0
        self.stopped = False  # a stop string was found: nothing follows
        self.tokens_used = 0  # tokens up to the one that completed the stop string (all of them otherwise)

    def add(self, ids: list[int]) -> str:
        """Take new token ids; returns the text that can be sent now (maybe empty)."""
        if self.stopped:
            return ""
        for t in ids:
            self.ids.append(t)
            self.tokens_used += 1
            prefix = self.tok.decode(self.ids[self._prefix:self._read])
            full = self.tok.decode(self.ids[self._prefix:])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self.text += full[len(prefix):]
                self._prefix, self._read = self._read, len(self.ids)
                if self._cut():
                    break
        return self._release(hold=True)

    def finish(self) -> str:
        """The rest of the text once generation has ended (an incomplete last character included)."""
        if not self.stopped:
            prefix = self.tok.decode(self.ids[self._prefix:self._read])
            full = self.tok.decode(self.ids[self._prefix:])
            self.text += full[len(prefix):]
            self._prefix = self._read = len(self.ids)
            self._cut()
        return self._release(hold=False)

    def _cut(self) -> bool:
        """End the text before the first stop string in it, if any (searching only where a new one can be)."""
        if not self.stop:
            return False
        longest = max(map(len, self.stop))
        start = max(0, self.sent - longest + 1)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if not hits:
            return False
        self.text = self.text[:min(hits)]
        self.stopped = True
        return True

    def _release(self, hold: bool) -> str:
        end = len(self.text)
        if hold and not self.stopped and self.stop:  # keep back a tail that may start a stop string
            for k in range(min(max(map(len, self.stop)) - 1, end - self.sent), 0, -1):
                tail = self.text[end - k:]
                if any(s.startswith(tail) for s in self.stop):
                    end -= k
                    break
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out
