// Formatting must read exactly like nbmem/formatting.py: the expected strings below are what
// fmt_bytes / fmt_seconds print (tests/test_widget.py also compares the two directly).
import assert from "node:assert/strict";
import { test } from "node:test";

import { fmtBytes, fmtSeconds, isNA } from "./format.js";

test("fmtBytes matches fmt_bytes: binary units, three significant digits", () => {
  /** @type {[number, string][]} */
  const cases = [
    [0, "0 B"], [1, "1 B"], [1023, "1023 B"], [1024, "1.00 KiB"], [1536, "1.50 KiB"],
    [10239, "10.00 KiB"], [10240, "10.0 KiB"], [102400, "100 KiB"], [1048575, "1024 KiB"],
    [1048576, "1.00 MiB"], [5767168, "5.50 MiB"], [123456789, "118 MiB"], [2 ** 30, "1.00 GiB"],
    [1.5 * 2 ** 30, "1.50 GiB"], [2 ** 40, "1.00 TiB"], [2 ** 50, "1.00 PiB"], [2 ** 60, "1024 PiB"],
    [-1152, "-1.12 KiB"], [-1048576, "-1.00 MiB"],
  ];
  for (const [n, want] of cases) assert.equal(fmtBytes(n), want, `fmtBytes(${n})`);
});

test("an exact tie rounds half to even, as Python's format() does", () => {
  assert.equal(fmtBytes(1152), "1.12 KiB"); // 1.125 KiB: toFixed alone would say 1.13
  assert.equal(fmtBytes(1408), "1.38 KiB"); // 1.375: the even neighbour is above
  assert.equal(fmtBytes(1179648), "1.12 MiB");
});

test("signed deltas carry + for growth, nothing for zero", () => {
  assert.equal(fmtBytes(1152, { signed: true }), "+1.12 KiB");
  assert.equal(fmtBytes(0, { signed: true }), "0 B");
  assert.equal(fmtBytes(-2048, { signed: true }), "-2.00 KiB");
});

test("unknown is NA, never 0", () => {
  for (const v of [null, undefined, NaN]) {
    assert.equal(fmtBytes(v), "NA");
    assert.equal(fmtSeconds(v), "NA");
    assert.ok(isNA(v));
  }
  assert.ok(!isNA(0));
});

test("fmtSeconds matches fmt_seconds", () => {
  /** @type {[number, string][]} */
  const cases = [[0.0004, "0 ms"], [0.5, "500 ms"], [1, "1.00 s"], [2.345, "2.35 s"], [119.99, "119.99 s"],
    [120, "2.0 min"], [3600, "60.0 min"]];
  for (const [s, want] of cases) assert.equal(fmtSeconds(s), want, `fmtSeconds(${s})`);
});
