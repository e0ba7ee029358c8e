//! `exp` for the softmax picker without a libm call per row.
//!
//! On baseline x86-64 `f64::exp` is a call into libm (≈ 45 instructions plus the call);
//! the picker needs one per candidate. Softmax exponents are bounded (`[−1/T, 0]` up to
//! rounding), so a table-driven `exp` that stays in registers is enough: it agrees with
//! `f64::exp` to about one ULP (relative error < 4.5e-16 in the tests below), is plain
//! IEEE arithmetic (no FMA, no platform libm), and therefore gives the same bits on every
//! platform for the same input.

/// Table size: `x = (32·m + j)·ln2/32 + r` with `|r| ≤ ln2/64`.
const N: i64 = 32;

/// `2^(j/32)` for `j = 0..32`, correctly rounded (bit patterns; generated with 60-digit
/// decimal arithmetic and checked against `f64::exp2` in the tests).
const EXP2_J_OVER_N: [u64; N as usize] = [
    0x3FF0000000000000,
    0x3FF059B0D3158574,
    0x3FF0B5586CF9890F,
    0x3FF11301D0125B51,
    0x3FF172B83C7D517B,
    0x3FF1D4873168B9AA,
    0x3FF2387A6E756238,
    0x3FF29E9DF51FDEE1,
    0x3FF306FE0A31B715,
    0x3FF371A7373AA9CB,
    0x3FF3DEA64C123422,
    0x3FF44E086061892D,
    0x3FF4BFDAD5362A27,
    0x3FF5342B569D4F82,
    0x3FF5AB07DD485429,
    0x3FF6247EB03A5585,
    0x3FF6A09E667F3BCD,
    0x3FF71F75E8EC5F74,
    0x3FF7A11473EB0187,
    0x3FF82589994CCE13,
    0x3FF8ACE5422AA0DB,
    0x3FF93737B0CDC5E5,
    0x3FF9C49182A3F090,
    0x3FFA5503B23E255D,
    0x3FFAE89F995AD3AD,
    0x3FFB7F76F2FB5E47,
    0x3FFC199BDD85529C,
    0x3FFCB720DCEF9069,
    0x3FFD5818DCFBA487,
    0x3FFDFC97337B9B5F,
    0x3FFEA4AFA2A490DA,
    0x3FFF50765B6E4540,
];

/// `32 / ln 2`.
const N_OVER_LN2: f64 = 46.166_241_308_446_83;
/// `ln2/32` split so that `k·LN2_OVER_N_HI` is exact for `|k| < 2^17` (36 significant bits).
const LN2_OVER_N_HI: f64 = f64::from_bits(0x3F96_2E42_FEFA_0000);
const LN2_OVER_N_LO: f64 = 5.145_609_244_655_338e-14;
/// `1.5·2^52`: adding it rounds a value of magnitude < 2^51 to the nearest integer, which
/// then sits in the low mantissa bits (no libm `round`).
const SHIFT: f64 = 6_755_399_441_055_744.0;
/// Inputs beyond this go to `f64::exp`: results stay normal and finite inside it.
const FAST_RANGE: f64 = 700.0;

/// `e^x`, within about one ULP of `f64::exp`; exact at 0. NaN, infinities and `|x| > 700`
/// (results below 1e-304 or above 1e304) are delegated to `f64::exp`.
#[inline]
pub(crate) fn exp(x: f64) -> f64 {
    if x.abs() <= FAST_RANGE {
        exp_in_range(x)
    } else {
        x.exp()
    }
}

#[inline(always)]
fn exp_in_range(x: f64) -> f64 {
    let z = x * N_OVER_LN2 + SHIFT;
    // Same exponent as SHIFT, so the bit difference is the rounded integer k.
    let k = z.to_bits() as i64 - SHIFT.to_bits() as i64;
    let kd = z - SHIFT;
    let r = (x - kd * LN2_OVER_N_HI) - kd * LN2_OVER_N_LO;
    // e^r − 1 on |r| ≤ ln2/64 by Taylor to degree 6: the remainder r⁷/7! is < 4e-18.
    let r2 = r * r;
    let p =
        r + r2 * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0)))));
    // 2^(k/32) = 2^(k >> 5) · 2^((k & 31)/32): add the power of two to the exponent field.
    let table = EXP2_J_OVER_N[(k & (N - 1)) as usize];
    let scale = f64::from_bits(table.wrapping_add(((k >> 5) << 52) as u64));
    scale + scale * p
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rel_err(x: f64) -> f64 {
        let (got, want) = (exp(x), x.exp());
        if got == want {
            0.0
        } else {
            ((got - want) / want).abs()
        }
    }

    #[test]
    fn table_is_exp2_of_j_over_n() {
        for (j, &bits) in EXP2_J_OVER_N.iter().enumerate() {
            let want = (j as f64 / N as f64).exp2();
            let got = f64::from_bits(bits);
            assert!(
                got.to_bits().abs_diff(want.to_bits()) <= 1,
                "j={j}: {got} vs {want}"
            );
        }
        assert_eq!(N_OVER_LN2, N as f64 / std::f64::consts::LN_2);
        let ln2_over_n = std::f64::consts::LN_2 / N as f64;
        assert!((LN2_OVER_N_HI + LN2_OVER_N_LO - ln2_over_n).abs() <= f64::EPSILON * ln2_over_n);
        assert_eq!(
            LN2_OVER_N_HI.to_bits() & 0xFFFF,
            0,
            "hi must leave room for k"
        );
    }

    #[test]
    fn matches_f64_exp_over_the_softmax_range() {
        // Dense over [-1/T, 0] for the usual temperatures, then the whole fast range.
        let mut worst: f64 = 0.0;
        for i in 0..=200_000 {
            let x = -(i as f64) / 200_000.0 * 10.0;
            worst = worst.max(rel_err(x));
        }
        let mut s = 0x2545_F491_4F6C_DD1D_u64;
        for _ in 0..1_000_000 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let x = ((s >> 11) as f64 / (1u64 << 53) as f64) * 2.0 * FAST_RANGE - FAST_RANGE;
            worst = worst.max(rel_err(x));
        }
        assert!(worst < 4.5e-16, "worst relative error {worst:e}");
    }

    #[test]
    fn edges() {
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-0.0), 1.0);
        for x in [
            -FAST_RANGE,
            FAST_RANGE,
            -FAST_RANGE - 1e-9,
            -745.2,
            -746.0,
            -1e300,
            709.0,
            710.0,
            f64::NEG_INFINITY,
            f64::INFINITY,
            f64::MIN_POSITIVE,
            -f64::MIN_POSITIVE,
            1e-300,
        ] {
            assert!(rel_err(x) < 1e-15, "{x}: {} vs {}", exp(x), x.exp());
        }
        assert!(exp(f64::NAN).is_nan());
        // Rounding boundaries of k (x near multiples of ln2/64).
        for k in -2_000..2_000 {
            let x = k as f64 * std::f64::consts::LN_2 / 64.0;
            for x in [x, x.next_up(), x.next_down()] {
                assert!(rel_err(x) < 1e-15, "{x}");
            }
        }
    }
}
