use super::*;
use proptest::prelude::*;
use serde_json::json;

/// A conversation from a list of turn kinds, in both protocols' tool shapes.
fn conversation(kinds: &[u8], anthropic: bool) -> Vec<Value> {
    let mut out = vec![json!({"role": "system", "content": "be brief"})];
    for (i, k) in kinds.iter().enumerate() {
        match k % 4 {
            0 => out.push(json!({"role": "user", "content": format!("question {i}")})),
            1 => out.push(json!({"role": "assistant", "content": format!("answer {i}")})),
            _ if anthropic => {
                out.push(json!({"role": "assistant", "content": [{"type": "tool_use", "id": format!("t{i}"), "name": "f", "input": {"i": i}}]}));
                out.push(json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": format!("t{i}"), "content": "ok"}]}));
            }
            n => {
                let calls: Vec<Value> = (0..n - 1)
                    .map(|c| json!({"id": format!("c{i}_{c}"), "type": "function", "function": {"name": "f", "arguments": "{}"}}))
                    .collect();
                out.push(json!({"role": "assistant", "content": null, "tool_calls": calls}));
                for c in 0..n - 1 {
                    out.push(json!({"role": "tool", "tool_call_id": format!("c{i}_{c}"), "content": "ok"}));
                }
            }
        }
    }
    out.push(json!({"role": "user", "content": "the last question"}));
    out
}

fn roles(ms: &[Value]) -> Vec<&str> {
    ms.iter().map(role).collect()
}

#[test]
fn drops_from_the_middle_and_keeps_the_ends() {
    let ms: Vec<Value> = [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
    ]
    .iter()
    .enumerate()
    .map(|(i, r)| json!({"role": r, "content": format!("m{i}")}))
    .collect();
    let costs = vec![10; ms.len()];
    assert_eq!(middle_out(&ms, &costs, 80), Some(vec![]));
    // Two messages must go: the middle ones (4, then 3), not the oldest.
    assert_eq!(middle_out(&ms, &costs, 60), Some(vec![3, 4]));
    // System, first user and last user (30) are kept whatever happens.
    assert_eq!(middle_out(&ms, &costs, 30), Some(vec![2, 3, 4, 5, 6]));
    assert_eq!(middle_out(&ms, &costs, 29), None);
}

#[test]
fn a_tool_call_goes_with_its_results() {
    let ms = conversation(&[0, 3, 1, 0, 1], false);
    // system, user, assistant(2 calls), tool, tool, assistant, user, assistant, last user
    assert_eq!(roles(&ms)[2..5], ["assistant", "tool", "tool"]);
    let costs = vec![5; ms.len()];
    let dropped = middle_out(&ms, &costs, 30).unwrap();
    assert!(
        dropped.contains(&2) == dropped.contains(&3)
            && dropped.contains(&3) == dropped.contains(&4)
    );
}

#[test]
fn counts_every_text_and_the_framing() {
    let m = json!({"role": "user", "content": [{"type": "text", "text": "Hello, world!"}, {"type": "image_url"}]});
    assert_eq!(
        message_tokens(&m, Tokenizer::O200k, u64::MAX, None),
        4 + MESSAGE_OVERHEAD_TOKENS
    );
    let call = json!({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "Hello, world!"}}]});
    assert_eq!(
        message_tokens(&call, Tokenizer::O200k, u64::MAX, None),
        4 + MESSAGE_OVERHEAD_TOKENS
    );
    let body = json!({"system": "Hello, world!", "messages": [m]});
    let e = prompt_tokens(body.as_object().unwrap(), Tokenizer::O200k, u64::MAX, None);
    assert_eq!(
        e,
        Estimate {
            tokens: 8 + MESSAGE_OVERHEAD_TOKENS,
            lower_bound: false
        }
    );
}

proptest! {
    #[test]
    fn middle_out_keeps_what_it_promises(
        kinds in proptest::collection::vec(0u8..4, 0..24),
        anthropic in any::<bool>(),
        cost_seed in proptest::collection::vec(0u64..60, 80),
        budget in 0u64..1500,
    ) {
        let ms = conversation(&kinds, anthropic);
        let costs: Vec<u64> = (0..ms.len()).map(|i| cost_seed[i % cost_seed.len()]).collect();
        let Some(dropped) = middle_out(&ms, &costs, budget) else {
            // Refused only when the total did not fit.
            prop_assert!(costs.iter().sum::<u64>() > budget);
            return Ok(());
        };
        let kept = |i: usize| !dropped.contains(&i);
        // The result fits.
        let kept_cost: u64 = (0..ms.len()).filter(|&i| kept(i)).map(|i| costs[i]).sum();
        prop_assert!(kept_cost <= budget);
        // System, the first user message and the last turn are kept.
        let first_user = ms.iter().position(|m| role(m) == "user").unwrap();
        let last_user = ms.iter().rposition(|m| role(m) == "user").unwrap();
        prop_assert!(kept(0) && kept(first_user));
        prop_assert!((last_user..ms.len()).all(kept));
        // A tool call and its results are kept or dropped together.
        for i in 0..ms.len() {
            if calls_tools(&ms[i]) {
                let mut j = i + 1;
                while j < ms.len() && answers_tools(&ms[j]) {
                    prop_assert_eq!(kept(i), kept(j), "call {} / result {}", i, j);
                    j += 1;
                }
            }
        }
        // Order kept: removing gives the kept messages in their original order.
        let mut after = ms.clone();
        remove(&mut after, &dropped);
        let expected: Vec<Value> = (0..ms.len()).filter(|&i| kept(i)).map(|i| ms[i].clone()).collect();
        prop_assert_eq!(after, expected);
    }
}
