//! Reciprocal Rank Fusion: within a class, a row scores `Σ 1/(LIST_RRF_K + rank)` over the ranked
//! lists it is in (full text, vectors, and any later signal); across classes,
//! `weight / (CLASS_RRF_K + rank in its class)`. Ranks start at 1.

use std::collections::HashMap;

use mnemo_core::RecallClass;
use mnemo_store::Ranked;
use uuid::Uuid;

/// RRF's constant where a class's lists of 50 candidates meet. The usual 60 (from fusing runs a
/// thousand deep) makes a list's first place worth only 1.15 times its tenth, so a row both
/// halves rank middling beats a row one half ranks first; at 10 the first is worth 1.8 times the
/// tenth. LoCoMo R@10 0.741–0.743 for any value from 5 to 12, 0.732 at 20 and at 60
/// (docs/benchmarks.md, "The lists' RRF constant").
pub const LIST_RRF_K: f64 = 10.0;

/// RRF's constant across classes, where the class priors act: flat, so that a prior of 1.3 lifts
/// a class's rows by several ranks, and the signals' bounded factor by a few.
pub const CLASS_RRF_K: f64 = 60.0;

/// Every candidate with its fused score, best first (ties by id, so the order repeats).
pub fn fuse(classes: &[(RecallClass, f64)], lists: &[&Ranked]) -> Vec<(Uuid, f64)> {
    let mut fused = Vec::new();
    for (class, weight) in classes {
        let mut in_class: HashMap<Uuid, f64> = HashMap::new();
        for list in lists.iter().filter_map(|ranked| ranked.get(&class.scope())) {
            for (rank, id) in list.iter().enumerate() {
                *in_class.entry(*id).or_default() += 1.0 / (LIST_RRF_K + rank as f64 + 1.0);
            }
        }
        let mut ranked: Vec<(Uuid, f64)> = in_class.into_iter().collect();
        sort(&mut ranked);
        fused.extend(
            ranked.into_iter().enumerate().map(|(rank, (id, _))| (id, weight / (CLASS_RRF_K + rank as f64 + 1.0))),
        );
    }
    sort(&mut fused);
    fused
}

fn sort(scores: &mut [(Uuid, f64)]) {
    scores.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
}

#[cfg(test)]
mod tests {
    use mnemo_core::{Scope, SessionId};

    use super::*;

    fn id(n: u128) -> Uuid {
        Uuid::from_u128(n)
    }

    #[test]
    fn a_row_in_both_lists_beats_rows_in_one() {
        let keyword = Ranked::from([(Scope::Tenant, vec![id(1), id(2)])]);
        let vector = Ranked::from([(Scope::Tenant, vec![id(3), id(2)])]);
        let fused = fuse(&[(RecallClass::Tenant, 1.0)], &[&keyword, &vector]);
        let order: Vec<Uuid> = fused.iter().map(|(id, _)| *id).collect();
        assert_eq!(order, [id(2), id(1), id(3)]);
    }

    #[test]
    fn a_first_place_in_one_half_beats_a_twentieth_in_both() {
        let others = |n: u128, count: u128| (100 * n..100 * n + count).map(id);
        let keyword =
            Ranked::from([(Scope::Tenant, [id(1)].into_iter().chain(others(1, 18)).chain([id(2)]).collect())]);
        let vector = Ranked::from([(Scope::Tenant, others(2, 19).chain([id(2)]).collect())]);
        let fused = fuse(&[(RecallClass::Tenant, 1.0)], &[&keyword, &vector]);
        let at = |wanted: u128| fused.iter().position(|(row, _)| *row == id(wanted)).expect("fused");
        assert!(at(1) < at(2), "first in one half, above twentieth in both: {} against {}", at(1), at(2));
    }

    #[test]
    fn class_priors_break_rank_ties_between_classes() {
        let session = RecallClass::Session(SessionId::parse("s").expect("session"));
        let keyword = Ranked::from([(Scope::Session, vec![id(1)]), (Scope::Tenant, vec![id(2)])]);
        let fused = fuse(&[(RecallClass::Tenant, 1.0), (session.clone(), 1.3)], &[&keyword]);
        assert_eq!(fused[0].0, id(1));
        assert!((fused[0].1 - 1.3 / 61.0).abs() < 1e-12);
        let fused = fuse(&[(RecallClass::Tenant, 2.0), (session, 1.3)], &[&keyword]);
        assert_eq!(fused[0].0, id(2));
    }

    #[test]
    fn any_number_of_lists_fuse_and_each_adds_its_share() {
        let lists: Vec<Ranked> = (0..3).map(|n| Ranked::from([(Scope::Tenant, vec![id(n), id(9)])])).collect();
        let refs: Vec<&Ranked> = lists.iter().collect();
        let fused = fuse(&[(RecallClass::Tenant, 1.0)], &refs);
        assert_eq!(fused[0].0, id(9), "the row in all three lists wins");
        assert!(fuse(&[(RecallClass::Tenant, 1.0)], &[]).is_empty());
    }
}
