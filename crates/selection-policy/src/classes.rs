//! The set of policy classes of a partition and how a request is mapped to one
//! (`scheduling.md` §5.1): by explicit name or family, else by uncached-ISL bucket, else the
//! default class.

use crate::config::{QueuePolicy, RouterConfig};
use crate::queue::{PolicyClass, QueueConfigError};

/// How requests reach a class besides its own name.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ClassRule {
    /// Other names an explicit request class (`x-dynamo-meta-policy-class`) may use.
    pub families: Vec<String>,
    /// Bucket lower bound on uncached ISL tokens (inclusive).
    pub min_uncached_isl: Option<u64>,
    /// Bucket upper bound on uncached ISL tokens (exclusive).
    pub max_uncached_isl: Option<u64>,
}

impl ClassRule {
    fn has_bucket(&self) -> bool {
        self.min_uncached_isl.is_some() || self.max_uncached_isl.is_some()
    }

    fn bucket_contains(&self, uncached: u64) -> bool {
        self.has_bucket()
            && self.min_uncached_isl.is_none_or(|m| uncached >= m)
            && self.max_uncached_isl.is_none_or(|m| uncached < m)
    }
}

/// One class of a policy file: its queue settings and its mapping rule.
#[derive(Debug, Clone, PartialEq)]
pub struct ClassDefinition {
    pub class: PolicyClass,
    pub rule: ClassRule,
}

/// Where a request's class came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClassSource {
    /// The explicit name matched a class name.
    Name,
    /// The explicit name matched a family of the class.
    Family,
    /// No (known) explicit name; the uncached ISL fell into the class's bucket.
    Bucket,
    /// Nothing matched.
    Default,
}

/// The outcome of [`PolicyClasses::classify`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Classified {
    /// Index into [`PolicyClasses::classes`] (and into the admission queue built from them).
    pub index: usize,
    pub source: ClassSource,
    /// An explicit name was given but matched no class or family (not an error: the
    /// request falls back to bucket and default classification).
    pub unknown_explicit: bool,
}

/// A validated, non-empty set of policy classes with one default.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyClasses {
    classes: Vec<PolicyClass>,
    rules: Vec<ClassRule>,
    default: usize,
}

impl PolicyClasses {
    /// The single synthetic `"default"` class used without a policy file.
    pub fn synthetic(config: &RouterConfig) -> Self {
        Self {
            classes: vec![PolicyClass::synthetic(config)],
            rules: vec![ClassRule::default()],
            default: 0,
        }
    }

    /// The classes of a policy file, in file order. `default_class` names the fallback;
    /// without it the class called `"default"` is, else the first class.
    ///
    /// Rejects: no classes, an empty or duplicate name, `quantum` 0, a negative or
    /// non-finite `prefill_busy_threshold_frac`, `lcfs` (synthetic class only), an empty
    /// ISL bucket (`min ≥ max`), a family claimed twice or equal to a class name, and an
    /// unknown `default_class`.
    pub fn from_definitions(
        definitions: Vec<ClassDefinition>,
        default_class: Option<&str>,
    ) -> Result<Self, QueueConfigError> {
        if definitions.is_empty() {
            return Err(QueueConfigError::NoClasses);
        }
        let mut classes = Vec::with_capacity(definitions.len());
        let mut rules = Vec::with_capacity(definitions.len());
        for ClassDefinition { class, rule } in definitions {
            if class.name.trim().is_empty() {
                return Err(QueueConfigError::EmptyName);
            }
            if classes.iter().any(|c: &PolicyClass| c.name == class.name) {
                return Err(QueueConfigError::DuplicateClass { class: class.name });
            }
            class.validate()?;
            if class.queue_policy == QueuePolicy::Lcfs {
                return Err(QueueConfigError::LcfsInPolicyFile { class: class.name });
            }
            if let (Some(min), Some(max)) = (rule.min_uncached_isl, rule.max_uncached_isl)
                && min >= max
            {
                return Err(QueueConfigError::EmptyIslBucket {
                    class: class.name,
                    min,
                    max,
                });
            }
            classes.push(class);
            rules.push(rule);
        }
        let mut seen: Vec<&str> = Vec::new();
        for (i, rule) in rules.iter().enumerate() {
            for family in &rule.families {
                if classes.iter().any(|c| c.name == *family) || seen.contains(&family.as_str()) {
                    return Err(QueueConfigError::DuplicateFamily {
                        class: classes[i].name.clone(),
                        family: family.clone(),
                    });
                }
                seen.push(family);
            }
        }
        let default = match default_class {
            Some(name) => classes.iter().position(|c| c.name == name).ok_or_else(|| {
                QueueConfigError::UnknownDefaultClass {
                    class: name.to_owned(),
                }
            })?,
            None => classes
                .iter()
                .position(|c| c.name == "default")
                .unwrap_or(0),
        };
        Ok(Self {
            classes,
            rules,
            default,
        })
    }

    /// The classes, in definition order.
    pub fn classes(&self) -> &[PolicyClass] {
        &self.classes
    }

    /// The mapping rule of the class at `index`.
    pub fn rule(&self, index: usize) -> Option<&ClassRule> {
        self.rules.get(index)
    }

    /// The fallback class.
    pub fn default_class(&self) -> &PolicyClass {
        &self.classes[self.default]
    }

    /// Queueing is enabled when any class has a busy threshold.
    pub fn queueing_enabled(&self) -> bool {
        self.classes.iter().any(PolicyClass::queueing_enabled)
    }

    /// Maps a request: its explicit name (trimmed; empty = none) against class names, then
    /// families; otherwise the first class in definition order whose bucket holds
    /// `uncached_isl`; otherwise the default class.
    pub fn classify(&self, explicit: Option<&str>, uncached_isl: u64) -> Classified {
        let explicit = explicit.map(str::trim).filter(|s| !s.is_empty());
        if let Some(name) = explicit {
            if let Some(index) = self.classes.iter().position(|c| c.name == name) {
                return Classified {
                    index,
                    source: ClassSource::Name,
                    unknown_explicit: false,
                };
            }
            if let Some(index) = self
                .rules
                .iter()
                .position(|r| r.families.iter().any(|f| f == name))
            {
                return Classified {
                    index,
                    source: ClassSource::Family,
                    unknown_explicit: false,
                };
            }
        }
        let unknown_explicit = explicit.is_some();
        match self
            .rules
            .iter()
            .position(|r| r.bucket_contains(uncached_isl))
        {
            Some(index) => Classified {
                index,
                source: ClassSource::Bucket,
                unknown_explicit,
            },
            None => Classified {
                index: self.default,
                source: ClassSource::Default,
                unknown_explicit,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn class(name: &str) -> PolicyClass {
        PolicyClass {
            name: name.into(),
            queue_policy: QueuePolicy::Fcfs,
            quantum: 1,
            prefill_busy_threshold: Some(10),
            prefill_busy_threshold_frac: None,
            request_queue_limit_per_worker: None,
            raw_isl_token_queue_limit_per_worker: None,
            cached_token_queue_limit_per_worker: None,
        }
    }

    fn def(name: &str, families: &[&str], min: Option<u64>, max: Option<u64>) -> ClassDefinition {
        ClassDefinition {
            class: class(name),
            rule: ClassRule {
                families: families.iter().map(|f| (*f).to_owned()).collect(),
                min_uncached_isl: min,
                max_uncached_isl: max,
            },
        }
    }

    fn sample() -> PolicyClasses {
        PolicyClasses::from_definitions(
            vec![
                def("interactive", &["chat", "agent"], None, Some(2048)),
                def("batch", &["offline"], Some(2048), None),
                def("fallback", &[], None, None),
            ],
            Some("fallback"),
        )
        .unwrap()
    }

    #[test]
    fn classification_order_is_name_family_bucket_default() {
        let set = sample();
        let check = |explicit: Option<&str>, uncached: u64, want: (&str, ClassSource, bool)| {
            let c = set.classify(explicit, uncached);
            let got = (
                set.classes()[c.index].name.as_str(),
                c.source,
                c.unknown_explicit,
            );
            assert_eq!(got, want, "{explicit:?} {uncached}");
        };
        check(Some("batch"), 10, ("batch", ClassSource::Name, false));
        check(
            Some(" fallback "),
            10,
            ("fallback", ClassSource::Name, false),
        );
        check(
            Some("agent"),
            9000,
            ("interactive", ClassSource::Family, false),
        );
        check(Some("offline"), 0, ("batch", ClassSource::Family, false));
        check(None, 2047, ("interactive", ClassSource::Bucket, false));
        check(None, 2048, ("batch", ClassSource::Bucket, false));
        check(Some(""), 5, ("interactive", ClassSource::Bucket, false));
        check(Some("nope"), 5000, ("batch", ClassSource::Bucket, true));

        let no_buckets = PolicyClasses::from_definitions(
            vec![def("a", &[], None, None), def("default", &[], None, None)],
            None,
        )
        .unwrap();
        assert_eq!(no_buckets.default_class().name, "default");
        let c = no_buckets.classify(Some("zzz"), 1);
        assert_eq!(
            (c.index, c.source, c.unknown_explicit),
            (1, ClassSource::Default, true)
        );
        let first = PolicyClasses::from_definitions(vec![def("a", &[], None, None)], None).unwrap();
        assert_eq!(first.default_class().name, "a");
    }

    #[test]
    fn synthetic_set_is_the_single_default_class() {
        let mut cfg = RouterConfig::default();
        let set = PolicyClasses::synthetic(&cfg);
        assert_eq!(set.classes().len(), 1);
        assert_eq!(set.default_class().name, "default");
        assert!(!set.queueing_enabled());
        cfg.router_queue_threshold = Some(0.5);
        cfg.router_queue_policy = QueuePolicy::Lcfs;
        let set = PolicyClasses::synthetic(&cfg);
        assert!(set.queueing_enabled());
        assert_eq!(set.classify(Some("x"), 0).index, 0);
    }

    #[test]
    fn invalid_definitions_are_typed_errors() {
        let check = |defs: Vec<ClassDefinition>, default: Option<&str>, want: QueueConfigError| {
            assert_eq!(
                PolicyClasses::from_definitions(defs, default).unwrap_err(),
                want
            );
        };
        check(vec![], None, QueueConfigError::NoClasses);
        check(
            vec![def(" ", &[], None, None)],
            None,
            QueueConfigError::EmptyName,
        );
        check(
            vec![def("a", &[], None, None), def("a", &[], None, None)],
            None,
            QueueConfigError::DuplicateClass { class: "a".into() },
        );
        let mut zero = def("z", &[], None, None);
        zero.class.quantum = 0;
        check(
            vec![zero],
            None,
            QueueConfigError::ZeroQuantum { class: "z".into() },
        );
        let mut frac = def("f", &[], None, None);
        frac.class.prefill_busy_threshold_frac = Some(f64::NAN);
        check(
            vec![frac],
            None,
            QueueConfigError::BadThreshold { class: "f".into() },
        );
        let mut lcfs = def("l", &[], None, None);
        lcfs.class.queue_policy = QueuePolicy::Lcfs;
        check(
            vec![lcfs],
            None,
            QueueConfigError::LcfsInPolicyFile { class: "l".into() },
        );
        check(
            vec![def("b", &[], Some(10), Some(10))],
            None,
            QueueConfigError::EmptyIslBucket {
                class: "b".into(),
                min: 10,
                max: 10,
            },
        );
        check(
            vec![def("a", &["x"], None, None), def("b", &["x"], None, None)],
            None,
            QueueConfigError::DuplicateFamily {
                class: "b".into(),
                family: "x".into(),
            },
        );
        check(
            vec![def("a", &["b"], None, None), def("b", &[], None, None)],
            None,
            QueueConfigError::DuplicateFamily {
                class: "a".into(),
                family: "b".into(),
            },
        );
        check(
            vec![def("a", &[], None, None)],
            Some("b"),
            QueueConfigError::UnknownDefaultClass { class: "b".into() },
        );
        let msg = QueueConfigError::LcfsInPolicyFile { class: "l".into() }.to_string();
        assert_eq!(
            msg,
            "policy class \"l\": queue_policy lcfs is not allowed in a policy file (use fcfs or wspt)"
        );
        assert_eq!(
            QueueConfigError::ZeroQuantum { class: "z".into() }.field(),
            "quantum"
        );
    }
}
