use super::*;

const TTL: u64 = 3_000;

fn quiet() -> Findings {
    Findings {
        down: false,
        cooldown_until_ms: 0,
        learned_limit: u32::MAX,
    }
}

fn signal(kind: Kind, for_ms: u64, ttl_ms: u64, limit: Option<u32>) -> Signal {
    Signal {
        replica: "r1".into(),
        pool: "p".into(),
        variant: "v".into(),
        kind,
        for_ms,
        limit,
        ttl_ms,
    }
}

#[test]
fn nothing_to_say_about_a_quiet_variant() {
    let mut said = Said::default();
    for now in [0, 100, 5_000] {
        assert!(news(&mut said, quiet(), now, TTL).is_empty());
    }
}

#[test]
fn an_ejection_is_a_lease_renewed_every_third_of_the_ttl_then_recovered() {
    let mut said = Said::default();
    let down = Findings {
        down: true,
        ..quiet()
    };
    assert_eq!(
        news(&mut said, down, 1_000, TTL),
        [(Kind::Eject, TTL, None)]
    );
    assert!(news(&mut said, down, 1_100, TTL).is_empty());
    assert!(news(&mut said, down, 1_999, TTL).is_empty());
    assert_eq!(
        news(&mut said, down, 2_000, TTL),
        [(Kind::Eject, TTL, None)]
    );
    assert_eq!(
        news(&mut said, quiet(), 2_100, TTL),
        [(Kind::Recovered, 0, None)]
    );
    assert!(news(&mut said, quiet(), 2_200, TTL).is_empty());
}

#[test]
fn a_cooldown_is_told_once_with_what_is_left_and_renewed_only_when_longer_than_the_ttl() {
    let mut said = Said::default();
    let cool = |until| Findings {
        cooldown_until_ms: until,
        ..quiet()
    };
    assert_eq!(
        news(&mut said, cool(1_500), 1_000, TTL),
        [(Kind::Cooldown, 500, None)]
    );
    assert!(news(&mut said, cool(1_500), 1_100, TTL).is_empty());
    // Over, then a longer one: capped by the TTL, renewed while it lasts.
    assert!(news(&mut said, cool(1_500), 1_600, TTL).is_empty());
    assert_eq!(
        news(&mut said, cool(60_000), 2_000, TTL),
        [(Kind::Cooldown, TTL, None)]
    );
    assert!(news(&mut said, cool(60_000), 2_500, TTL).is_empty());
    assert_eq!(
        news(&mut said, cool(60_000), 3_000, TTL),
        [(Kind::Cooldown, TTL, None)]
    );
}

#[test]
fn a_limit_is_told_when_it_drops_not_when_it_grows_back() {
    let mut said = Said::default();
    let limit = |l| Findings {
        learned_limit: l,
        ..quiet()
    };
    assert_eq!(
        news(&mut said, limit(6), 0, TTL),
        [(Kind::Limit, TTL, Some(6))]
    );
    assert!(news(&mut said, limit(6), 100, TTL).is_empty());
    assert!(news(&mut said, limit(7), 200, TTL).is_empty());
    assert_eq!(
        news(&mut said, limit(5), 300, TTL),
        [(Kind::Limit, TTL, Some(5))]
    );
}

#[test]
fn a_hold_is_never_longer_than_either_ttl_and_never_shortens_one_in_force() {
    // The sender's expectation, its TTL and ours: the shortest wins.
    assert_eq!(
        hold_until(0, 1_000, &signal(Kind::Eject, 9_000, 4_000, None), 2_000),
        3_000
    );
    assert_eq!(
        hold_until(0, 1_000, &signal(Kind::Eject, 9_000, 1_000, None), 2_000),
        2_000
    );
    assert_eq!(
        hold_until(0, 1_000, &signal(Kind::Cooldown, 300, 9_000, None), 9_000),
        1_300
    );
    // A hold in force that ends later stays.
    assert_eq!(
        hold_until(
            5_000,
            1_000,
            &signal(Kind::Cooldown, 300, 9_000, None),
            9_000
        ),
        5_000
    );
}

#[test]
fn caps_take_the_lowest_while_one_holds_and_lapse_after_the_ttl() {
    let mut caps = Caps::default();
    let at = |l| signal(Kind::Limit, TTL, TTL, Some(l));
    assert_eq!(caps.merge(&at(8), 0, TTL), Some(8));
    assert_eq!(caps.merge(&at(12), 1_000, TTL), Some(8));
    assert_eq!(caps.merge(&at(5), 2_000, TTL), Some(5));
    assert!(caps.lapsed(4_999).is_empty());
    assert_eq!(caps.lapsed(5_000), [("p".to_owned(), "v".to_owned())]);
    // After it lapsed, a new signal starts afresh.
    assert_eq!(caps.merge(&at(12), 6_000, TTL), Some(12));
    // A limit signal without a limit is not one.
    assert_eq!(
        caps.merge(&signal(Kind::Limit, TTL, TTL, None), 0, TTL),
        None
    );
}

#[test]
fn the_wire_format_is_plain_json_and_strangers_are_refused() {
    let s = signal(Kind::Limit, TTL, TTL, Some(3));
    let text = serde_json::to_string(&s).unwrap();
    assert_eq!(
        text,
        r#"{"replica":"r1","pool":"p","variant":"v","kind":"limit","for_ms":3000,"limit":3,"ttl_ms":3000}"#
    );
    assert_eq!(serde_json::from_str::<Signal>(&text).unwrap(), s);
    assert!(serde_json::from_str::<Signal>(
        r#"{"replica":"r","pool":"p","variant":"v","kind":"melt","ttl_ms":1}"#
    )
    .is_err());
    assert!(serde_json::from_str::<Signal>(r#"{"pool":"p"}"#).is_err());
}
