// Human formatting for the gauge, mirroring nbmem/formatting.py so the widget and the text reports
// print the same number the same way. Data arrives as raw bytes; only this module turns it into text.

const UNITS = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];

/**
 * True for the values nbmem uses to mean "unknown": null, undefined and NaN.
 * @param {unknown} value
 * @returns {value is null | undefined}
 */
export function isNA(value) {
  return value === null || value === undefined || (typeof value === "number" && Number.isNaN(value));
}

/**
 * Round `num / den` half to even and print it with `digits` decimals, exactly (BigInt), because
 * Python's format() rounds the exact binary value half-to-even while toFixed() rounds ties up:
 * 1152 B must read "1.12 KiB" on both sides.
 * @param {bigint} num
 * @param {bigint} den
 * @param {number} digits
 * @returns {string}
 */
function exactFixed(num, den, digits) {
  const scaled = num * 10n ** BigInt(digits);
  let q = scaled / den;
  const twice = 2n * (scaled % den);
  if (twice > den || (twice === den && q % 2n === 1n)) q += 1n;
  if (digits === 0) return q.toString();
  const s = q.toString().padStart(digits + 1, "0");
  return `${s.slice(0, -digits)}.${s.slice(-digits)}`;
}

/**
 * Bytes in binary units with three significant digits; "NA" for unknown (never 0).
 * @param {number | null | undefined} n
 * @param {{signed?: boolean}} [opts] signed: prefix "+" to positive values (for deltas)
 * @returns {string}
 */
export function fmtBytes(n, opts = {}) {
  if (isNA(n)) return "NA";
  const sign = n < 0 ? "-" : opts.signed && n > 0 ? "+" : "";
  const abs = Math.abs(n);
  let v = abs;
  let unit = 0;
  while (v >= 1024 && unit < UNITS.length - 1) {
    v /= 1024;
    unit += 1;
  }
  if (unit === 0) return `${sign}${Math.trunc(v)} B`;
  const digits = v < 10 ? 2 : v < 100 ? 1 : 0;
  const text = Number.isSafeInteger(abs) ? exactFixed(BigInt(abs), 1024n ** BigInt(unit), digits) : v.toFixed(digits);
  return `${sign}${text} ${UNITS[unit]}`;
}

/**
 * A duration: ms below a second, else seconds or minutes (as formatting.fmt_seconds).
 * @param {number | null | undefined} s
 * @returns {string}
 */
export function fmtSeconds(s) {
  if (isNA(s)) return "NA";
  if (s < 1) return `${(s * 1000).toFixed(0)} ms`;
  if (s < 120) return `${s.toFixed(2)} s`;
  return `${(s / 60).toFixed(1)} min`;
}
