"""A JSON schema's number bounds (minimum, maximum, exclusiveMinimum, exclusiveMaximum) as a
regex of exactly the texts within them, for runtime/guide.py: the classic range-to-regex
construction. The n-digit integers from a to b are O(n) alternatives, each a prefix they share, a
class of digits and [0-9]{k}; a range is split by its number of digits, and an unbounded side is
"more digits" ([1-9][0-9]{n,}). Fractions alike, digit by digit, runs of one digit (0.000001) as
d{k}. A bounded number is written without exponent, as xgrammar writes it.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal
from fractions import Fraction


BOUNDS = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")
# A range's alternatives are O(n) of O(n) digits for bounds of n digits: two 80-digit bounds of
# random digits expand to ~25,000 NFA states (regex_fsm.MAX_NFA_STATES is 100,000).
MAX_BOUND_DIGITS = 80


def _group(alternatives: list[str]) -> str:
    return "(?:" + "|".join(alternatives) + ")"


def _run_length(digits: str) -> str:
    """A string of digits as a regex, a run of one digit longer than 3 as d{k}."""
    return re.sub(r"(\d)\1{3,}", lambda m: f"{m.group(1)}{{{len(m.group())}}}", digits)


def _repeat(d: str, lo: int, hi: int) -> str:
    """d repeated lo..hi times, as a regex."""
    if hi == 0:
        return ""
    if lo == hi:
        return d if lo == 1 else f"{d}{{{lo}}}"
    return f"{d}?" if (lo, hi) == (0, 1) else f"{d}{{{lo},{hi}}}"


def _digit_class(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"[{lo}-{hi}]"


def _free(k: int) -> str:
    """Any k digits."""
    return "" if k == 0 else "[0-9]" if k == 1 else f"[0-9]{{{k}}}"


def _tails(s: str, up: bool) -> list[tuple[str, str, int]]:
    """The digit strings of len(s) that are >= s (up) or <= s, as (literal, class, k): the
    literal, a digit of the class, then any k digits. s is not all 0s (up) or all 9s."""
    last = max(j for j, d in enumerate(s) if d != ("0" if up else "9"))
    out = []
    for j in range(last + 1):
        d = int(s[j])
        if j == last:  # s[j] itself, with any rest: the rest of s is 0s (up) or 9s
            out.append((s[:j], _digit_class(d, 9) if up else _digit_class(0, d), len(s) - j - 1))
        elif d != (9 if up else 0):
            out.append((s[:j], _digit_class(d + 1, 9) if up else _digit_class(0, d - 1),
                        len(s) - j - 1))
    return out


def _same_length(a: str, b: str) -> list[str]:
    """Alternatives for the digit strings of len(a) == len(b) from a to b (a <= b)."""
    if a == b:
        return [_run_length(a)]
    i = next(j for j in range(len(a)) if a[j] != b[j])
    lo, hi, rest = int(a[i]), int(b[i]), len(a) - i - 1
    low = high = []
    if a[i + 1:].strip("0"):  # a[i] with a rest >= a's, apart from the digits above it
        low = [_run_length(a[:i + 1] + lit) + cls + _free(k) for lit, cls, k in
               _tails(a[i + 1:], up=True)]
        lo += 1
    if b[i + 1:].strip("9"):
        high = [_run_length(b[:i + 1] + lit) + cls + _free(k) for lit, cls, k in
                _tails(b[i + 1:], up=False)]
        hi -= 1
    middle = [_run_length(a[:i]) + _digit_class(lo, hi) + _free(rest)] if lo <= hi else []
    return low + middle + high


def _naturals(lo: int, hi: int | None) -> list[str]:
    """Alternatives for the texts of the integers lo..hi (hi None: no end), 0 <= lo <= hi, in
    JSON's form (no leading zero)."""
    a, n = str(lo), len(str(lo))
    if hi is not None and len(str(hi)) == n:
        return _same_length(a, str(hi))
    if (lo, hi) == (0, None):
        return ["0", "[1-9][0-9]*"]
    out = _same_length(a, "9" * n)
    if hi is None:
        return out + ["[1-9][0-9]" + ("+" if n == 1 else f"{{{n},}}")]
    m = len(str(hi))
    if m >= n + 2:  # every integer of n + 1 .. m - 1 digits
        out.append("[1-9]" + (_free(n) if m == n + 2 else f"[0-9]{{{n},{m - 2}}}"))
    return out + _same_length("1" + "0" * (m - 1), str(hi))


def _integer_range(lo: int | None, hi: int | None) -> str:
    """The regex of the integers lo..hi (None: unbounded), lo <= hi, as JSON writes them: no
    leading zero, no + and no -0."""
    alternatives = []
    if hi is None or hi >= 0:
        alternatives += _naturals(0 if lo is None else max(lo, 0), hi)
    if lo is None or lo < 0:
        alternatives.append("-" + _group(_naturals(1 if hi is None or hi >= 0 else -hi,
                                                   None if lo is None else -lo)))
    return _group(alternatives)


def _fraction_ge(s: str, nonempty: bool) -> list[str]:
    """Alternatives for the digit strings t (of at least one digit if nonempty) with 0.t >= 0.s;
    s without trailing zeros."""
    if not s:
        return ["[0-9]+" if nonempty else "[0-9]*"]
    out = []
    for m in re.finditer(r"(\d)\1*", s):  # s[:j] then a greater digit, for j in the run
        d, head = int(m.group(1)), _run_length(s[:m.start()])
        if m.end() == len(s) and len(m.group()) == 1:  # s's last digit or a greater one
            return out + [head + _digit_class(d, 9) + "[0-9]*"]
        if d != 9:
            out.append(head + _repeat(m.group(1), 0, len(m.group()) - 1)
                       + _digit_class(d + 1, 9) + "[0-9]*")
    return out + [_run_length(s) + "[0-9]*"]


def _fraction_le(s: str, nonempty: bool) -> list[str]:
    """As _fraction_ge, with 0.t <= 0.s: s[:j] alone or with a smaller digit, or s with 0s."""
    if not s:
        return ["0+" if nonempty else "0*"]
    out = []
    for m in re.finditer(r"(\d)\1*", s):
        d, start, count = int(m.group(1)), m.start(), len(m.group())
        head, first = _run_length(s[:start]), nonempty and start == 0  # t may not be s[:0]
        if d == 0:
            if count - 1 >= first:
                out.append(head + _repeat("0", int(first), count - 1))
            continue
        smaller = _digit_class(0, d - 1) + "[0-9]*"
        if first:
            out.append(_repeat(m.group(1), 0, count - 1) + smaller)
            if count > 1:
                out.append(_repeat(m.group(1), 1, count - 1))
        else:
            out.append(head + _repeat(m.group(1), 0, count - 1) + f"(?:{smaller})?")
    return out + [_run_length(s) + "0*"]


def _fraction_between(a: str, b: str, nonempty: bool) -> list[str]:
    """As _fraction_ge, with 0.a <= 0.t <= 0.b (0.a < 0.b)."""
    width = max(len(a), len(b))
    pa, pb = a.ljust(width, "0"), b.ljust(width, "0")
    i = next(j for j in range(width) if pa[j] != pb[j])
    out = []
    if len(a) <= i:  # t a prefix of b's first i digits, from a on: a and 0s
        least = int(nonempty and not a)
        if i - len(a) >= least:
            out.append(_run_length(a) + _repeat("0", least, i - len(a)))
    lo, hi = int(pa[i]), int(pb[i])
    out.append(_run_length(pa[:i + 1]) + _group(_fraction_ge(pa[i + 1:].rstrip("0"), False)))
    if lo + 1 <= hi - 1:
        out.append(_run_length(pa[:i]) + _digit_class(lo + 1, hi - 1) + "[0-9]*")
    return out + [_run_length(pb[:i + 1]) + _group(_fraction_le(b[i + 1:], False))]


def _split(x):
    """A Decimal >= 0 as (its integer part, its fraction's digits without trailing zeros)."""
    whole, _, fraction = f"{x:f}".partition(".")
    return int(whole), fraction.rstrip("0")


def _decimals(a, b) -> list[str]:
    """Alternatives for the texts without exponent of the numbers a..b (Decimals; b None: no
    end), 0 <= a <= b, the integer part in JSON's form."""
    (ai, af), any_fraction = _split(a), r"(?:\.[0-9]+)?"
    bi, bf = _split(b) if b is not None else (None, "")
    if ai == bi:
        if af == bf:
            return [str(ai) + (r"(?:\.0+)?" if not af else rf"\.{_run_length(af)}0*")]
        between = _group(_fraction_between(af, bf, True))
        return [str(ai) + (rf"(?:\.{between})?" if not af else rf"\.{between}")]
    out = []
    if af:  # ai with a fraction >= a's, then the integers after it
        out.append(rf"{ai}\.{_group(_fraction_ge(af, True))}")
        ai += 1
    if bi is None or ai <= bi - 1:
        out.append(_group(_naturals(ai, None if bi is None else bi - 1)) + any_fraction)
    if bi is not None:
        out.append(rf"{bi}(?:\.{_group(_fraction_le(bf, True))})?")
    return out


def _number_range(lo, hi) -> str:
    """The regex of the texts without exponent of the numbers lo..hi (Decimals; None: unbounded),
    lo <= hi. -0 (as -0.0) is written where 0 is within them, as json.loads reads it: 0."""
    zero, alternatives = Decimal(0), []
    if hi is None or hi >= 0:
        alternatives += _decimals(zero if lo is None else max(lo, zero), hi)
    if lo is None or lo < 0:
        alternatives.append("-" + _group(_decimals(
            zero if hi is None or hi >= 0 else hi.copy_negate(),
            None if lo is None else lo.copy_negate())))
    return _group(alternatives)


def _written(value) -> Decimal:
    """A JSON number as written: an int exactly, a float as its shortest repr (0.1, not the
    double's 0.1000000000000000055...)."""
    return Decimal(repr(value)) if isinstance(value, float) else Decimal(value)


def bounds_of(schema: dict) -> dict:
    """The schema's bounds ({keyword: number}); ValueError for one that is not a finite number."""
    out = {}
    for key in BOUNDS:
        if key not in schema:
            continue
        value = schema[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                isinstance(value, float) and not math.isfinite(value):
            draft4 = (" (draft 4's boolean form, beside minimum / maximum, is not supported: give "
                      "the bound itself)" if isinstance(value, bool) else "")
            raise ValueError(f"JSON schema {key} must be a finite number, got "
                             f"{value!r:.60}{draft4}")
        out[key] = value
    return out


def holds(value, key: str, bound) -> bool:
    """Whether a number satisfies one bound, both as written (decimals) and as Python compares
    what json.loads reads (ints exactly, floats as doubles)."""
    v, w, b = value, _written(value), _written(bound)
    if key == "minimum":
        return v >= bound and w >= b
    if key == "exclusiveMinimum":
        return v > bound and w > b
    if key == "maximum":
        return v <= bound and w <= b
    return v < bound and w < b


def describe_bounds(bounds: dict) -> str:
    """The bounds as the schema writes them, an integer of over 40 digits by its length."""
    def shown(value) -> str:
        if not isinstance(value, int) or value.bit_length() < 128:
            return f"{value!r:.40}"
        digits = len(str(abs(value))) if value.bit_length() < 1000 else "over 300"
        return f"(an integer of {digits} digits)"
    return ", ".join(f"{key} {shown(value)}" for key, value in bounds.items())


def _check_digits(bounds: dict, *ends) -> None:
    """ValueError for ends (ints or Decimals) of more than MAX_BOUND_DIGITS integer digits."""
    for end in ends:  # a Decimal's copy_abs, exact (abs() would round it to 28 digits)
        if end is not None and (end.copy_abs() if isinstance(end, Decimal) else abs(end)) \
                >= 10 ** MAX_BOUND_DIGITS:
            raise ValueError(f"JSON schema {describe_bounds(bounds)}: bounds of more than "
                             f"{MAX_BOUND_DIGITS} digits are not supported")


def _interval(bounds: dict, end_of, what: str) -> tuple:
    """(lo, hi) of the values within every bound (None: unbounded), each bound's end given by
    end_of(key, value); ValueError where none is within them or an end is too long."""
    lo = hi = None
    for key, value in bounds.items():
        end = end_of(key, value)
        if key.endswith("inimum"):
            lo = end if lo is None else max(lo, end)
        else:
            hi = end if hi is None else min(hi, end)
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"JSON schema {describe_bounds(bounds)}: no {what} is within them")
    _check_digits(bounds, lo, hi)
    return lo, hi


def _integer_end(key: str, value) -> int:
    """The first (minimum, exclusiveMinimum) or last integer within one bound; a fractional
    bound rounded inward (minimum 1.5: 2 on), read both as written and as a double (maximum
    1e30: neither 10**30 + 1 nor the double's 1000000000000000019884624838656 is in)."""
    readings = (Fraction(value), _written(value))
    if key == "minimum":
        return max(math.ceil(x) for x in readings)
    if key == "exclusiveMinimum":
        return max(math.floor(x) for x in readings) + 1
    if key == "maximum":
        return min(math.floor(x) for x in readings)
    return min(math.ceil(x) for x in readings) - 1


def integer_bounds_regex(bounds: dict) -> str:
    """The integers within the bounds (see _integer_end)."""
    return _integer_range(*_interval(bounds, _integer_end, "integer"))


def _number_end(key: str, value):
    """The Decimal D such that every decimal from D on (minimum, exclusiveMinimum) or up to D
    satisfies the bound both as a decimal against the bound as written and as the double
    json.loads reads: a double's shortest repr, the bound's own for an inclusive one, the next
    double's past it for an exclusive one (exclusiveMinimum 0.5: 0.5000000000000001 on, as
    0.50000000000000001 is read as the double 0.5)."""
    try:
        c = float(value)
    except OverflowError:
        raise ValueError(f"JSON schema {key} {value!r:.40} is beyond a double's range") from None
    toward = math.inf if key.endswith("inimum") else -math.inf
    for _ in range(4):
        if not math.isfinite(c):
            break
        if holds(c, key, value):
            return Decimal(repr(c))
        c = math.nextafter(c, toward)
    raise ValueError(f"JSON schema {key} {value!r:.40}: no double is within it")


def number_bounds_regex(bounds: dict) -> str:
    """The texts without exponent (as xgrammar writes a bounded number) of the numbers within
    the bounds (see _number_end)."""
    return _number_range(*_interval(bounds, _number_end, "number"))
