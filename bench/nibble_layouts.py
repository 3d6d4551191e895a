"""Is there a re-layout of packed e2m1 nibbles that decodes to fp16 (or bf16) pairs with one shift and one mask?

Two weights per 32-bit register come out as (word >> o) & M, with M the bits an e2m1 value occupies in an fp16
pair (sign at 15, exponent and mantissa at 11..9, and the same 16 bits up) or a bf16 pair (15; 8..6). If the
nibbles could be stored so that k such windows (offsets o, left shifts allowed) cover a 32- or 64-bit word (one
or two registers, funnel shifts) exactly once, the decode would cost 2 instructions per pair instead of ~4-5.
Exhaustive exact-cover search over the offsets: prints the tilings found (none). No GPU needed.

    python bench/nibble_layouts.py
"""

from __future__ import annotations

PAIRS = {"fp16": (9, 10, 11, 15, 25, 26, 27, 31), "bf16": (6, 7, 8, 15, 22, 23, 24, 31)}


def tilings(bits: tuple[int, ...], width: int, limit: int = 3) -> list[tuple[int, ...]]:
    """Offset sets o_1 < o_2 < ... whose windows {b + o} partition range(width)."""
    windows = {}
    for o in range(-min(bits), width - max(bits)):
        windows[o] = sum(1 << (b + o) for b in bits)
    full, found = (1 << width) - 1, []

    def rec(cover: int, chosen: list[int]) -> None:
        if len(found) >= limit:
            return
        if cover == full:
            found.append(tuple(chosen))
            return
        low = (~cover & (cover + 1)).bit_length() - 1  # the lowest uncovered bit must be covered next
        for o, m in windows.items():
            if (m >> low) & 1 and not m & cover:
                rec(cover | m, chosen + [o])

    rec(0, [])
    return found


def main():
    for name, bits in PAIRS.items():
        for width in (32, 64):
            print(f"{name} pairs, {width}-bit word: {tilings(bits, width) or 'no tiling'}")


if __name__ == "__main__":
    main()
