"""Hidden checks of ``encode_code`` and ``decode_code``: a keyed bijection onto 7-character codes."""

from __future__ import annotations

from autograder.harness import Report, error_line, replica, task
from autograder.probes import in_fresh_process
from autograder.wire import each
from course import shortener
from course.chapters import ch12

ALPHABET = set(shortener.ALPHABET)
TOP = shortener.ID_SPACE
OTHER_KEY = b"another deployment's secret key"  # a replica configured with this key must make other codes


def _with_key(r: Report, key: bytes, ids: list[int]) -> list:
    """The codes of ``ids`` from a replica of the answer cell run with ``CODE_KEY = key`` (in the notebook's
    names and in course.shortener, wherever the cell takes it from)."""
    remote = getattr(r.namespace, "call_with", None)
    if remote is not None:  # graded: the replica is made, and called, in the learner's process
        return remote("encode_code", {"CODE_KEY": key}, {"course.shortener": {"CODE_KEY": key}}, [[n] for n in ids])
    saved_ns, saved_mod = r.namespace.get("CODE_KEY"), shortener.CODE_KEY
    r.namespace["CODE_KEY"] = shortener.CODE_KEY = key
    try:
        encode = replica(r.namespace, "encode_code")
        return [encode(n) for n in ids]
    finally:
        shortener.CODE_KEY = saved_mod
        if saved_ns is None:
            r.namespace.pop("CODE_KEY", None)
        else:
            r.namespace["CODE_KEY"] = saved_ns


def _onto_misses(encode_code, decode_code, samples: list[str]) -> list | None:
    """``(code, id)`` of each sample code that does not encode back to itself, in two round trips; None
    when a call raised (the check then asks one code at a time, as it reports each)."""
    try:
        ids = each(decode_code, samples)
        if not all(isinstance(n, int) and 0 <= n < TOP for n in ids):
            return None
        again = each(encode_code, ids)
    except Exception:  # noqa: BLE001 - learner code may raise anything: asked again one by one
        return None
    return [(c, n) for c, n, a in zip(samples, ids, again, strict=True) if a != c]


def _is_code(value) -> bool:
    return isinstance(value, str) and len(value) == shortener.CODE_LENGTH and set(value) <= ALPHABET


# ============================================================================ encode_code / decode_code


@task(
    "encode_code",
    points=3,
    title="7-character codes from a keyed shuffle of the id",
    needs=("encode_code", "decode_code"),
    timeout=60,
    seed=1212,
)
async def check_codes(r: Report, encode_code, decode_code) -> None:
    code = encode_code(1)
    r.expect(
        _is_code(code),
        f"encode_code(1) = {code!r}: 7 characters of 0-9, A-Z, a-z",
        f"encode_code(1) returned {code!r}; expected a str of 7 characters from 0-9, A-Z, a-z",
    )
    back = decode_code(code)
    r.expect(back == 1, f"decode_code({code!r}) = 1", f"decode_code({code!r}) returned {back!r}, expected 1")
    first = each(encode_code, range(1, 21))  # one round trip for all (the answer runs in its own process)
    shared, _ = ch12.consecutive_stats(first)
    r.expect(
        len(set(first)) == 20 and shared < 2,
        f"ids 1..20 give 20 different codes that share {shared:.2f} of 7 characters with the next on average",
        f"ids 1..20 give {first[:4]} ...: {len(set(first))} different codes; a code and the next share "
        f"{shared:.1f} of 7 characters on average. Consecutive ids must not give neighbouring codes: shuffle the id first",
    )
    if r.public:
        return

    # --- a bijection of [0, 62**7) ----------------------------------------------------------------
    edges = [0, 1, 2, 61, 62, 62**6, TOP // 2, TOP - 2, TOP - 1]
    ids = edges + [r.random.randrange(TOP) for _ in range(2000)]
    codes = each(encode_code, ids)
    bad = [(n, c) for n, c in zip(ids, codes, strict=True) if not _is_code(c)]
    r.expect(
        not bad,
        f"{len(ids)} ids (0, 62**7 - 1 and {len(ids) - len(edges)} random ones): every code is 7 base62 characters",
        f"encode_code({bad[0][0] if bad else ''}) returned {bad[0][1] if bad else ''!r}: every id in "
        "[0, 62**7) needs a code of exactly 7 characters of 0-9, A-Z, a-z (pad with the zero character)",
    )
    wrong = list(zip(ids, codes, each(decode_code, codes), strict=True))
    wrong = [w for w in wrong if w[2] != w[0]]
    r.expect(
        not wrong,
        "decode_code(encode_code(n)) == n for all of them",
        f"decode_code(encode_code({wrong[0][0] if wrong else ''})) = {wrong[0][2] if wrong else ''!r}: "
        "decode must undo encode for every id. (Shuffling 42 bits? A value at or above 62**7 must be permuted "
        "again until it lands below, cycle-walking; cutting it with % loses the way back)",
    )
    r.expect(
        len(set(codes)) == len(set(ids)),
        "no two ids share a code",
        f"{len(set(ids))} different ids gave only {len(set(codes))} different codes",
    )
    samples = ["".join(r.random.choice(shortener.ALPHABET) for _ in range(7)) for _ in range(2000)]
    misses = _onto_misses(encode_code, decode_code, samples)
    if misses is None:
        misses = []
        for c in samples:
            try:
                n = decode_code(c)
                again = encode_code(n) if isinstance(n, int) and 0 <= n < TOP else None
            except ValueError as err:
                n, again = err, None
            if again != c:
                misses.append((c, n))
    r.expect(
        not misses,
        "2000 random 7-character codes: each decodes to an id in [0, 62**7) that encodes back to it (onto)",
        f"decode_code({misses[0][0] if misses else ''!r}) gave {misses[0][1] if misses else ''!r}, which does not "
        "encode back to that code: a bijection of [0, 62**7) maps every 7-character code to one id (a Feistel "
        "network on 42 bits needs cycle-walking to stay inside the range)",
    )
    refused = {}
    for label, call in (
        ("encode_code(62**7)", lambda: encode_code(TOP)),
        ("encode_code(-1)", lambda: encode_code(-1)),
        ("decode_code('abc')", lambda: decode_code("abc")),
        ("decode_code('abc!def')", lambda: decode_code("abc!def")),
    ):
        try:
            refused[label] = f"returned {call()!r}"
        except ValueError:
            refused[label] = "ValueError"
        except Exception as err:  # noqa: BLE001 - learner code may raise anything
            refused[label] = f"raised {error_line(err, 60)}"
    odd = {k: v for k, v in refused.items() if v != "ValueError"}
    r.expect(
        not odd,
        "out of range ids and malformed codes raise ValueError",
        "expected ValueError for ids outside [0, 62**7) and codes that are not 7 base62 characters: "
        + "; ".join(f"{k} {v}" for k, v in odd.items()),
    )

    # --- guessability ------------------------------------------------------------------------------
    runs = [1, r.random.randrange(10**6, 10**9), TOP - 1001]
    consecutive = []
    for start in runs:
        consecutive += each(encode_code, range(start, start + 1000))
        consecutive.append("")  # no pair across two runs
    shared, end = ch12.consecutive_stats([c for c in consecutive if c])
    r.expect(
        shared < 1.0,
        f"3 x 1000 consecutive ids: neighbouring codes share {shared:.2f} of 7 characters on average (random: 0.11)",
        f"codes of consecutive ids share {shared:.2f} of 7 characters on average: anyone holding one code finds "
        "the others by changing a character or two. Shuffle the id with a keyed permutation before base62",
    )
    r.expect(
        end < 0.5,
        f"the end characters of one code do not predict the next code's ({end:.0%} of pairs follow the most "
        "common move; random: about 10%)",
        f"in {end:.0%} of consecutive pairs the first or last character of the next code is the one this code's "
        "leads to most often: the shuffle is a fixed step (multiplying or adding a constant), and two codes "
        "give away all the others. Use a keyed permutation (a Feistel network) instead",
    )

    # --- replicas ------------------------------------------------------------------------------------
    (enc_b,) = r.replicas("encode_code", 1)
    (dec_c,) = r.replicas("decode_code", 1)
    probe = [r.random.randrange(TOP) for _ in range(200)]
    same = sum(enc_b(n) == encode_code(n) for n in probe)
    across = sum(dec_c(encode_code(n)) == n for n in probe)
    r.expect(
        same == len(probe) and across == len(probe),
        "two more replicas of your cell give the same codes and decode each other's",
        f"a second replica of your cell gives the same code for {same} of {len(probe)} ids, and a third decodes "
        f"{across} of {len(probe)} of the first one's codes: the key or the shuffle is drawn when the cell runs, "
        "so each replica of the service makes codes the others cannot resolve. Use the configured CODE_KEY",
    )
    # the key: a replica configured with another CODE_KEY must make other codes (a shuffle that ignores the
    # key is one anybody who knows the algorithm can undo)
    keyed = _with_key(r, OTHER_KEY, probe)
    unchanged = sum(c == encode_code(n) for c, n in zip(keyed, probe, strict=True))
    r.expect(
        unchanged < len(probe) // 10,
        "a replica of your cell configured with another CODE_KEY makes other codes (the shuffle is keyed)",
        f"a replica of your cell configured with another CODE_KEY gives the same code for {unchanged} of "
        f"{len(probe)} ids: the shuffle does not depend on the key, so anyone who knows the algorithm (a Feistel "
        "network is in every textbook) can compute every code. Likely causes: a round function hashed without "
        "the key (hashlib.blake2b(..., key=CODE_KEY), or hmac.new(CODE_KEY, ...)), or a key copied into the cell "
        "as a literal; use CODE_KEY",
    )
    # another process, whose hash() of a str or bytes differs (PYTHONHASHSEED): the replicas above share
    # this process's, so a round function built on hash() would agree with itself there and only there
    few = probe[:50]
    try:
        got = in_fresh_process(
            r, [("encode_code", [n]) for n in few] + [("decode_code", [encode_code(n)]) for n in few]
        )
    except LookupError as err:
        r.note(f"the check could not give another process the notebook name {err} your cell uses: it skipped that step")
        return
    except RuntimeError as err:
        r.fail(str(err))
    codes, back = got[: len(few)], got[len(few) :]
    same = sum(x.get("ok") == encode_code(n) for x, n in zip(codes, few, strict=True))
    across = sum(x.get("ok") == n for x, n in zip(back, few, strict=True))
    errors = [x["error"] for x in got if "error" in x]
    r.expect(
        same == len(few) and across == len(few),
        "a replica in another Python process (another PYTHONHASHSEED) gives the same codes and decodes yours",
        f"a replica in another Python process gives the same code for {same} of {len(few)} ids and decodes {across} "
        f"of {len(few)} of yours"
        + (f" (it raised {errors[0]})" if errors else "")
        + ". Python's hash() of a str or bytes changes from process to process (PYTHONHASHSEED): derive the round "
        "function from CODE_KEY with hashlib (or hmac), which every process computes alike",
    )
