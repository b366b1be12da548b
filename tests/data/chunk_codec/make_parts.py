#!/usr/bin/env python3
"""Writes parts.json, the golden part streams of the ScoreChunked part codec
(README.md in this directory states the rules they pin down).

Regenerate after changing a case (run from anywhere; no build needed):

    python3 tests/data/chunk_codec/make_parts.py

With the generated Python stubs on PYTHONPATH (build/python), every case
that parses is also checked against protobuf's own parser of
ScoreRequestPart. The bytes are written here by a small encoder of its own,
not by either codec under test; parts.json, not this script, is the
reference the C++ (tests/chunk_codec_test.cc) and Python
(client/python/tests/test_codec_golden.py) tests read.
"""

import json
import os
import sys

U64 = (1 << 64) - 1


def varint(n):
    """Minimal base-128 varint of 0 <= n < 2**64."""
    assert 0 <= n <= U64
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def tag(field, wire_type):
    return varint(field << 3 | wire_type)


def vint(field, n):
    """A varint field; a negative n is sign-extended to 64 bits (10 bytes)."""
    return tag(field, 0) + varint(n & U64)


def ld(field, body):
    return tag(field, 2) + varint(len(body)) + body


def fixed64(field):
    return tag(field, 1) + bytes(range(1, 9))


def fixed32(field):
    return tag(field, 5) + bytes(range(1, 5))


def piece(tensor, offset, data):
    """A piece part exactly as PieceHeader / piece_header write it (every
    field present, minimal varints, in field order) followed by its data."""
    return ld(2, vint(1, tensor) + vint(2, offset) + ld(3, data))


REQUEST = b"\x0a\x03r-1"  # ScoreRequest{id: "r-1"}
DATA = b"abcde"


def message(name, part, body, note):
    return {"name": name, "note": note, "part": part.hex(), "expect": {"message": body.hex()}}


def pieced(name, part, tensor, offset, data, note, canonical=False):
    case = {"name": name, "note": note, "part": part.hex(),
            "expect": {"piece": {"tensor": tensor, "offset": offset, "data": data.hex()}}}
    if canonical:
        assert part == piece(tensor, offset, data)
    case["canonical"] = canonical
    return case


def error(name, part, keyword, note):
    return {"name": name, "note": note, "part": part.hex(), "expect": {"error": keyword}}


def cases():
    unknown_before = vint(3, 7) + fixed64(4)
    unknown_after = ld(5, b"xyz") + fixed32(6) + vint(15, 1 << 63)  # 1 << 63: a 10-byte varint
    unknown_top = unknown_before + unknown_after
    unknown_in_piece = vint(4, 9) + fixed64(5) + ld(6, b"??") + fixed32(7) + vint(536870911, 1)
    overlong_11 = b"\xff" * 10 + b"\x00"  # 11 bytes
    overflow_10 = b"\xff" * 9 + b"\x02"  # 10 bytes, 65 bits
    yield from [
        # Messages.
        message("message", ld(1, REQUEST), REQUEST, "a message part: field 1's bytes as they are"),
        message("message_empty", ld(1, b""), b"", "an empty message (a ScoreRequest of defaults) is a message"),
        message("message_unknown_fields_skipped", unknown_before + ld(1, REQUEST) + unknown_after, REQUEST,
                "unknown fields of every skippable wire type around the message are skipped"),
        message("message_unknown_field_number_max", vint(536870911, 5) + ld(1, REQUEST), REQUEST,
                "field number 2^29 - 1, the largest, is an unknown field"),
        # Pieces.
        pieced("piece", piece(3, 4096, DATA), 3, 4096, DATA, "a piece part", canonical=True),
        pieced("piece_offset_0", piece(0, 0, DATA), 0, 0, DATA, "tensor 0 and offset 0, written explicitly",
               canonical=True),
        pieced("piece_offset_2_byte_varint", piece(1, 300, DATA), 1, 300, DATA, "offset 300: a 2-byte varint",
               canonical=True),
        pieced("piece_offset_2_pow_35", piece(2, 1 << 35, DATA), 2, 1 << 35, DATA, "offset 2^35: a 6-byte varint",
               canonical=True),
        pieced("piece_offset_int64_max", piece(2147483647, (1 << 63) - 1, DATA), 2147483647, (1 << 63) - 1, DATA,
               "the largest tensor (2^31 - 1, 5 bytes) and offset (2^63 - 1, 9 bytes)", canonical=True),
        pieced("piece_300_bytes", piece(5, 600, bytes(range(256)) + bytes(44)), 5, 600, bytes(range(256)) + bytes(44),
               "300 bytes of data: the piece's and the data's lengths are 2-byte varints", canonical=True),
        pieced("piece_empty_data", piece(4, 12, b""), 4, 12, b"", "a data field of length 0", canonical=True),
        pieced("piece_defaults_omitted", ld(2, b""), 0, 0, b"",
               "an empty piece as protobuf writes it (defaults left out): tensor 0, offset 0, no data"),
        pieced("piece_fields_reversed", ld(2, ld(3, DATA) + vint(2, 77) + vint(1, 6)), 6, 77, DATA,
               "a piece's fields in any order"),
        pieced("piece_non_minimal_varints", ld(2, b"\x08\x81\x00\x10\x80\x80\x00" + ld(3, DATA)), 1, 0, DATA,
               "varints with redundant continuation bytes are read by value"),
        pieced("piece_unknown_fields_skipped", ld(2, vint(1, 2) + unknown_in_piece + vint(2, 8) + ld(3, DATA)),
               2, 8, DATA, "unknown fields of every skippable wire type inside the piece are skipped"),
        pieced("piece_unknown_top_level_fields_skipped", unknown_top + piece(1, 16, DATA) + vint(9, 1), 1, 16, DATA,
               "unknown fields before and after the piece are skipped"),
        # Neither, both, duplicates.
        error("empty_part", b"", "neither a message nor a piece", "no fields at all"),
        error("only_unknown_fields", unknown_top, "neither a message nor a piece", "unknown fields only"),
        error("message_then_piece", ld(1, REQUEST) + piece(0, 0, DATA), "both a message and a piece",
              "a message and a piece in one part"),
        error("piece_then_message", piece(0, 0, DATA) + ld(1, REQUEST), "both a message and a piece",
              "a piece and a message in one part"),
        error("two_pieces", piece(0, 0, DATA) + piece(0, 5, DATA), "duplicate",
              "two pieces in one part (not merged)"),
        error("two_messages", ld(1, REQUEST) + ld(1, REQUEST), "duplicate", "two messages in one part (not merged)"),
        error("piece_duplicate_tensor", ld(2, vint(1, 1) + vint(1, 2) + ld(3, DATA)), "duplicate",
              "a piece's tensor given twice"),
        error("piece_duplicate_offset", ld(2, vint(2, 1) + vint(2, 2) + ld(3, DATA)), "duplicate",
              "a piece's offset given twice"),
        error("piece_duplicate_data", ld(2, ld(3, DATA) + ld(3, DATA)), "duplicate", "a piece's data given twice"),
        # Truncated varints.
        error("truncated_tag", b"\x8a", "truncated", "the part ends inside a tag's varint"),
        error("truncated_message_length", b"\x0a\x85", "truncated", "the part ends inside field 1's length"),
        error("truncated_piece_length", b"\x12\xff\xff", "truncated", "the part ends inside field 2's length"),
        error("truncated_tensor", b"\x12\x02\x08\x96", "truncated", "the part ends inside the tensor's varint"),
        error("truncated_offset_at_piece_end", b"\x12\x04\x08\x01\x10\x96\x01", "truncated",
              "the offset's varint would end past the piece's length (the byte after the piece is not read)"),
        error("truncated_unknown_varint", ld(1, REQUEST) + b"\x18\xff", "truncated",
              "the part ends inside an unknown varint field"),
        error("truncated_varint_9_bytes", b"\x12\x0a\x08" + b"\xff" * 9, "truncated",
              "nine bytes of a ten-byte varint, then the end of the piece"),
        # Truncated length-delimited and fixed-size fields.
        error("truncated_message", b"\x0a\x05" + REQUEST[:3], "truncated", "field 1 is longer than the part"),
        error("truncated_piece", piece(1, 0, DATA)[:-1], "truncated", "field 2 is longer than the part"),
        error("truncated_data_at_piece_end", ld(2, vint(1, 1) + b"\x1a\x05" + DATA[:2]) + DATA[2:], "truncated",
              "the data's length runs past the piece, though the part has the bytes"),
        error("truncated_unknown_length_delimited", ld(1, REQUEST) + b"\x2a\x04ab", "truncated",
              "an unknown length-delimited field longer than the part"),
        error("truncated_unknown_fixed64", ld(1, REQUEST) + b"\x21" + bytes(7), "truncated",
              "an unknown fixed64 field with 7 of its 8 bytes"),
        error("truncated_unknown_fixed32_in_piece", ld(2, vint(1, 1) + b"\x25\x00\x00") + b"\x00\x00", "truncated",
              "an unknown fixed32 field running past the piece"),
        # Overlong varints.
        error("overlong_tag", overlong_11 + ld(1, REQUEST), "overlong varint", "an 11-byte tag"),
        error("overlong_tensor", ld(2, b"\x08" + overlong_11), "overlong varint", "an 11-byte tensor varint"),
        error("overflowing_offset", ld(2, b"\x10" + overflow_10), "overlong varint",
              "a 10-byte offset varint whose last byte is 2: 65 bits"),
        # Negative and out-of-range values.
        error("negative_tensor", piece(-1, 0, DATA), "negative", "tensor -1 (a 10-byte varint)"),
        error("negative_tensor_int32_min", piece(-(1 << 31), 0, DATA), "negative", "tensor -2^31"),
        error("tensor_out_of_range", ld(2, vint(1, 1 << 31) + ld(3, DATA)), "out of range",
              "tensor 2^31: does not fit int32 (protobuf would truncate it)"),
        error("negative_offset", piece(0, -1, DATA), "negative", "offset -1 (a 10-byte varint)"),
        error("negative_offset_int64_min", piece(0, -(1 << 63), DATA), "negative", "offset -2^63"),
        # Wire types.
        error("message_as_varint", vint(1, 5), "wire type", "field 1 with wire type 0"),
        error("message_as_fixed64", fixed64(1), "wire type", "field 1 with wire type 1"),
        error("piece_as_fixed32", fixed32(2), "wire type", "field 2 with wire type 5"),
        error("piece_as_varint", vint(2, 0) + ld(1, REQUEST), "wire type", "field 2 with wire type 0"),
        error("tensor_length_delimited", ld(2, ld(1, b"\x01") + ld(3, DATA)), "wire type",
              "the tensor as a length-delimited field"),
        error("offset_fixed64", ld(2, fixed64(2) + ld(3, DATA)), "wire type", "the offset as a fixed64 field"),
        error("data_as_varint", ld(2, vint(1, 0) + vint(3, 5)), "wire type", "the data as a varint field"),
        error("unknown_start_group", ld(1, REQUEST) + tag(3, 3) + tag(3, 4), "wire type",
              "groups (wire types 3 and 4) are not supported, even as unknown fields"),
        error("unknown_end_group_in_piece", ld(2, tag(9, 4)), "wire type", "an end-group tag inside a piece"),
        error("wire_type_6", ld(1, REQUEST) + tag(3, 6), "wire type", "wire type 6 does not exist"),
        error("wire_type_7_in_piece", ld(2, tag(4, 7)), "wire type", "wire type 7 does not exist"),
        # Field numbers.
        error("field_number_0", ld(0, b"") + ld(1, REQUEST), "field number", "field number 0 is invalid"),
        error("field_number_0_in_piece", ld(2, vint(0, 1)), "field number", "field number 0 inside a piece"),
        error("field_number_2_pow_29", vint(1 << 29, 1) + ld(1, REQUEST), "field number",
              "field number 2^29: above the largest, 2^29 - 1"),
        error("field_number_aliasing_1", varint((1 << 32 | 1) << 3 | 2) + b"\x00", "field number",
              "a tag whose field number is 1 modulo 2^32 is not field 1"),
    ]


def check_with_protobuf(all_cases):
    """Parses every valid case with protobuf's ScoreRequestPart (when the
    generated stubs are importable) and compares."""
    try:
        from logprob.v1 import logprob_pb2 as pb2
    except ImportError:
        print("logprob_pb2 not importable (add build/python to PYTHONPATH): protobuf check skipped")
        return
    for c in all_cases:
        expect = c["expect"]
        if "error" in expect:
            continue
        part = pb2.ScoreRequestPart.FromString(bytes.fromhex(c["part"]))
        if "message" in expect:
            assert part.WhichOneof("part") == "request", c["name"]
            assert part.request == pb2.ScoreRequest.FromString(bytes.fromhex(expect["message"])), c["name"]
        else:
            p = expect["piece"]
            assert part.WhichOneof("part") == "piece", c["name"]
            got = (part.piece.tensor, part.piece.offset, part.piece.data.hex())
            assert got == (p["tensor"], p["offset"], p["data"]), (c["name"], got)
    print("valid cases agree with protobuf")


def main():
    all_cases = list(cases())
    names = [c["name"] for c in all_cases]
    assert len(names) == len(set(names)), "duplicate case names"
    check_with_protobuf(all_cases)
    comment = "Golden ScoreChunked parts; rules in README.md. Generated by make_parts.py: do not edit by hand."
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "parts.json")
    with open(path, "w") as f:  # one case a line
        f.write('{"comment": %s,\n "cases": [\n' % json.dumps(comment))
        f.write(",\n".join("  " + json.dumps(c) for c in all_cases))
        f.write("\n]}\n")
    print("wrote %d cases to %s" % (len(all_cases), path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
