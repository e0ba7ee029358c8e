//! Field-level serde helpers of the DTO files: the signed rendering of hashes (§1.3), the
//! multimodal block infos, `null` read as the default, the range checks of
//! `router_config_override`, and the partition names' default. A leaf: every DTO file builds
//! on it and it on none of them.

use kv_types::{BlockMmInfo, MmObject, i64_from_u64, u64_from_i64};
use serde::{Deserialize, Deserializer, Serializer};

/// `model_name` and `routing_group` when absent.
pub(super) fn default_name() -> String {
    "default".to_owned()
}

pub(super) fn ser_opt_signed<S: Serializer>(v: &Option<Vec<u64>>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(hashes) => s.collect_seq(hashes.iter().map(|&h| i64_from_u64(h))),
        None => s.serialize_none(),
    }
}

pub(super) fn de_opt_signed<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u64>>, D::Error> {
    // i64 and u64 have the same layout, so this collect reuses the allocation.
    let v: Option<Vec<i64>> = Option::deserialize(d)?;
    Ok(v.map(|v| v.into_iter().map(u64_from_i64).collect()))
}

#[derive(Deserialize)]
struct WireBlockExtraInfo {
    mm_objects: Vec<WireMmObject>,
}

#[derive(Deserialize)]
struct WireMmObject {
    mm_hash: u64,
    offsets: Vec<[u64; 2]>,
}

fn convert_mm_infos(v: Vec<Option<WireBlockExtraInfo>>) -> Vec<Option<BlockMmInfo>> {
    v.into_iter()
        .map(|b| {
            b.map(|b| BlockMmInfo {
                mm_objects: b
                    .mm_objects
                    .into_iter()
                    .map(|o| MmObject {
                        mm_hash: o.mm_hash,
                        offsets: o.offsets,
                    })
                    .collect(),
            })
        })
        .collect()
}

pub(super) fn de_block_mm_infos<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Vec<Option<BlockMmInfo>>, D::Error> {
    let v: Option<Vec<Option<WireBlockExtraInfo>>> = Option::deserialize(d)?;
    Ok(v.map(convert_mm_infos).unwrap_or_default())
}

pub(super) fn de_null_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

pub(super) fn de_opt_non_negative<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<f64>, D::Error> {
    let v: Option<f64> = Option::deserialize(d)?;
    match v {
        Some(x) if !(x.is_finite() && x >= 0.0) => Err(serde::de::Error::custom(format!(
            "must be finite and non-negative, got {x}"
        ))),
        other => Ok(other),
    }
}

pub(super) fn de_opt_unit_interval<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<f64>, D::Error> {
    let v: Option<f64> = Option::deserialize(d)?;
    match v {
        Some(x) if !(0.0..=1.0).contains(&x) => Err(serde::de::Error::custom(format!(
            "must be between 0 and 1, got {x}"
        ))),
        other => Ok(other),
    }
}
