//! Typed long-term memory against a real PostgreSQL: typed facts and their bad input, access
//! control beyond the tenant (randomized, like recall's isolation test), ranking signals,
//! access tracking through its job, promotion and fading, and memory packs within budgets.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use mnemo_config::{ContextSettings, RecallSettings, ServerSettings};
use mnemo_core::{Label, Principal, RecallScope, SignalWeights, TokenCounter};
use mnemo_recall::{Query, Recall, RecallOptions};
use mnemo_store::queue::AccessJob;
use mnemo_store::{CommonLexemes, SearchScope};
use mnemo_testkit::{
    LazyEmbedder, ScriptedEmbeddings, TestApp, embed_like_the_provider, principal, server_env, token, unit_bag_of_words,
};
use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use uuid::Uuid;

const MODEL: &str = "scripted";
const DIMS: usize = 64;

async fn app() -> (TestApp, ScriptedEmbeddings) {
    let provider = ScriptedEmbeddings::start(DIMS).await;
    let app = TestApp::spawn_with(&provider.env(MODEL)).await;
    (app, provider)
}

fn with_roles(mut who: Principal, roles: &[&str]) -> Principal {
    who.roles = roles.iter().map(|r| Label::parse("roles", r).expect("role")).collect();
    who
}

async fn fact(app: &TestApp, who: &Principal, body: Value) -> mnemo_testkit::Reply {
    app.client.post("/v1/facts", Some(&token(who)), &body).await
}

fn id_of(reply: &mnemo_testkit::Reply) -> Uuid {
    assert!(reply.status == 201 || reply.status == 200, "{:?}", reply.body);
    reply.body["id"].as_str().and_then(|s| s.parse().ok()).expect("id")
}

async fn layer_of(app: &TestApp, id: Uuid) -> String {
    sqlx::query_scalar("SELECT layer FROM memory_items WHERE id = $1")
        .bind(id)
        .fetch_one(&app.db.pool)
        .await
        .expect("layer")
}

#[tokio::test]
async fn typed_facts_are_stored_and_bad_input_writes_nothing() {
    let (app, _provider) = app().await;
    let ann = principal("acme", Some("ann"), Some("helper"), Some("s1"));
    let first = fact(&app, &ann, json!({"scope": "user", "content": "Ann drinks green tea"})).await;
    let target = id_of(&first);
    let reply = fact(
        &app,
        &ann,
        json!({
            "scope": "user", "content": "Ann stopped drinking coffee in May",
            "layer": "episodic", "category": "preference", "importance": 0.9, "confidence": 0.8,
            "tags": ["Drinks", "health"], "relations": [{"type": "related_to", "target": target}],
            "visibility": "agent", "allowed_roles": ["coach"], "source": "user",
        }),
    )
    .await;
    let id = id_of(&reply);
    let row: Value = sqlx::query_scalar(
        "SELECT to_jsonb(r) FROM (SELECT layer, category, importance, confidence, tags, origin, visibility,
                                         allowed_roles FROM memory_items WHERE id = $1) r",
    )
    .bind(id)
    .fetch_one(&app.db.pool)
    .await
    .expect("row");
    let expected = json!({
        "layer": "episodic", "category": "preference", "importance": 0.9, "confidence": 0.8,
        "tags": ["drinks", "health"], "origin": "user", "visibility": "agent", "allowed_roles": ["coach"],
    });
    assert_eq!(row, expected);
    let relation: (String, Uuid) =
        sqlx::query_as("SELECT relation, target_id FROM memory_relations WHERE item_id = $1")
            .bind(id)
            .fetch_one(&app.db.pool)
            .await
            .expect("relation");
    assert_eq!(relation, ("related_to".into(), target));
    // Defaults: a plain fact is semantic, private, made through the API.
    let plain: (String, String, String) =
        sqlx::query_as("SELECT layer, visibility, origin FROM memory_items WHERE id = $1")
            .bind(target)
            .fetch_one(&app.db.pool)
            .await
            .expect("row");
    assert_eq!(plain, ("semantic".into(), "private".into(), "api".into()));

    let other = principal("globex", Some("bob"), Some("helper"), None);
    let foreign = id_of(&fact(&app, &other, json!({"scope": "user", "content": "Bob's secret"})).await);
    // A fact retired by a newer one is no longer live.
    let retired = id_of(&fact(&app, &ann, json!({"scope": "user", "content": "Ann lived in Lyon"})).await);
    sqlx::query("UPDATE memory_items SET superseded_by = $2, superseded_at = now(), valid_to = now() WHERE id = $1")
        .bind(retired)
        .bind(target)
        .execute(&app.db.pool)
        .await
        .expect("supersede");
    let many = |n: usize| (0..n).map(|i| format!("t{i}")).collect::<Vec<_>>();
    let relations = |n: usize| (0..n).map(|_| json!({"type": "related_to", "target": target})).collect::<Vec<_>>();
    let cases = [
        (json!({"importance": 1.5}), "invalid_field"),
        (json!({"confidence": -0.1}), "invalid_field"),
        (json!({"importance": "high"}), "invalid_field"),
        (json!({"layer": "working"}), "invalid_value"),
        (json!({"category": "gossip"}), "invalid_value"),
        (json!({"visibility": "public"}), "invalid_value"),
        (json!({"source": "extraction"}), "invalid_value"),
        (json!({"relations": [{"type": "cousin_of", "target": target}]}), "invalid_value"),
        (json!({"relations": [{"type": "related_to", "target": "nope"}]}), "invalid_field"),
        // The id in another spelling than the schema's (braced).
        (json!({"relations": [{"type": "related_to", "target": format!("{{{target}}}")}]}), "invalid_field"),
        (json!({"relations": [{"type": "related_to", "target": foreign}]}), "relation_target_not_found"),
        (json!({"relations": [{"type": "related_to", "target": Uuid::now_v7()}]}), "relation_target_not_found"),
        (json!({"relations": [{"type": "derived_from", "target": retired}]}), "relation_target_not_found"),
        (json!({"relations": relations(17)}), "too_many_values"),
        (json!({"tags": many(17)}), "too_many_values"),
        (json!({"tags": ["two words"]}), "invalid_value"),
        (json!({"allowed_roles": many(9)}), "too_many_values"),
    ];
    let before = app.db.count("SELECT count(*) FROM memory_items").await;
    for (extra, code) in cases {
        let mut body = json!({"scope": "user", "content": format!("bad {extra}")});
        body.as_object_mut().expect("object").extend(extra.as_object().expect("object").clone());
        let reply = fact(&app, &ann, body.clone()).await;
        assert_eq!((reply.status, reply.code()), (400, code), "{body}: {:?}", reply.body);
    }
    // An agent's memory is already its users'; a user fact shared with an agent needs one.
    let agent_private = fact(&app, &ann, json!({"scope": "agent", "content": "x", "visibility": "private"})).await;
    assert_eq!((agent_private.status, agent_private.code()), (400, "invalid_value"));
    let no_agent = principal("acme", Some("ann"), None, None);
    let reply = fact(&app, &no_agent, json!({"scope": "user", "content": "y", "visibility": "agent"})).await;
    assert_eq!((reply.status, reply.code()), (400, "invalid_value"));
    // The same fact asserted again with other readers is refused, whatever the order.
    let again = json!({"scope": "user", "content": "Ann stopped drinking coffee in May", "visibility": "tenant"});
    let reply = fact(&app, &ann, again).await;
    assert_eq!((reply.status, reply.code()), (409, "source_ref_conflict"), "{:?}", reply.body);
    // Shared with another agent, it has other readers: that agent's users, not helper's.
    let elsewhere = principal("acme", Some("ann"), Some("coach"), Some("s1"));
    let shared = json!({
        "scope": "user", "content": "Ann stopped drinking coffee in May", "visibility": "agent",
        "allowed_roles": ["coach"], "source": "user",
    });
    let reply = fact(&app, &elsewhere, shared).await;
    assert_eq!((reply.status, reply.code()), (409, "source_ref_conflict"), "{:?}", reply.body);
    assert_eq!(app.db.count("SELECT count(*) FROM memory_items").await, before, "a refused write wrote something");
    assert_eq!(app.db.count("SELECT count(*) FROM memory_relations").await, 1);
    // A fact naming itself adds no relation; asserting it again is idempotent.
    let same = json!({
        "scope": "user", "content": "Ann drinks green tea", "relations": [{"type": "related_to", "target": target}],
    });
    assert_eq!(fact(&app, &ann, same).await.status, 200);
    assert_eq!(app.db.count("SELECT count(*) FROM memory_relations").await, 1);

    // Each re-assertion adds its new relations; one that would take the memory past 16 is
    // refused whole, and asserting those it holds again changes nothing.
    let mut targets = Vec::new();
    for i in 0..17 {
        targets.push(id_of(&fact(&app, &ann, json!({"scope": "user", "content": format!("target {i}")})).await));
    }
    let holder = json!({"scope": "user", "content": "Ann likes lists"});
    let holder_id = id_of(&fact(&app, &ann, holder.clone()).await);
    let held = format!("SELECT count(*) FROM memory_relations WHERE item_id = '{holder_id}'");
    let naming = |targets: &[Uuid]| {
        let mut body = holder.clone();
        body["relations"] = targets.iter().map(|t| json!({"type": "related_to", "target": t})).collect();
        body
    };
    assert_eq!(fact(&app, &ann, naming(&targets[..10])).await.status, 200);
    let refused = fact(&app, &ann, naming(&targets[8..])).await;
    assert_eq!((refused.status, refused.code()), (400, "too_many_values"), "{:?}", refused.body);
    assert_eq!(app.db.count(&held).await, 10, "a refused re-assertion adds nothing");
    assert_eq!(fact(&app, &ann, naming(&targets[4..16])).await.status, 200);
    assert_eq!(fact(&app, &ann, naming(&targets[..16])).await.status, 200);
    assert_eq!(app.db.count(&held).await, 16);
    let refused = fact(&app, &ann, naming(&targets[16..])).await;
    assert_eq!((refused.status, refused.code()), (400, "too_many_values"), "{:?}", refused.body);
    assert_eq!(app.db.count(&held).await, 16);

    // Two writes of one memory in one transaction count each other's relations: the first goes
    // in, the second would take the memory to 17.
    let mut first = json!({"scope": "user", "content": "Ann likes batches"});
    let mut second = first.clone();
    first["relations"] = targets[..10].iter().map(|t| json!({"type": "related_to", "target": t})).collect();
    second["relations"] = targets[7..].iter().map(|t| json!({"type": "related_to", "target": t})).collect();
    let reply = app.client.post("/v1/facts/batch", Some(&token(&ann)), &json!({ "items": [first, second] })).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    assert!(reply.body["results"][0]["id"].is_string(), "{:?}", reply.body);
    assert_eq!(reply.body["results"][1]["error"]["code"], "too_many_values", "{:?}", reply.body);
    let batched: Uuid = reply.body["results"][0]["id"].as_str().and_then(|id| id.parse().ok()).expect("id");
    let held = format!("SELECT count(*) FROM memory_relations WHERE item_id = '{batched}'");
    assert_eq!(app.db.count(&held).await, 10);

    // A retry after the target it holds a relation to was retired is answered as the first was.
    let derived = json!({"scope": "user", "content": "Ann reads lists", "relations": [{"type": "derived_from", "target": targets[0]}]});
    assert_eq!(fact(&app, &ann, derived.clone()).await.status, 201);
    sqlx::query("UPDATE memory_items SET superseded_by = $2, superseded_at = now(), valid_to = now() WHERE id = $1")
        .bind(targets[0])
        .bind(target)
        .execute(&app.db.pool)
        .await
        .expect("supersede");
    let retried = fact(&app, &ann, derived).await;
    assert_eq!((retried.status, retried.body["was_new"].clone()), (200, json!(false)), "{:?}", retried.body);

    // Another user of the agent restating an agent fact adds no relation to it: refused, as a
    // revival or a new key of theirs would be. Restated without relations, it lands as before.
    let agent_fact = json!({"scope": "agent", "content": "the office closes at six"});
    let office = id_of(&fact(&app, &ann, agent_fact.clone()).await);
    let bob = principal("acme", Some("bob"), Some("helper"), None);
    let mut linked = agent_fact.clone();
    linked["relations"] = json!([{"type": "related_to", "target": target}]);
    let reply = fact(&app, &bob, linked.clone()).await;
    assert_eq!((reply.status, reply.code()), (409, "source_ref_conflict"), "{:?}", reply.body);
    let held = format!("SELECT count(*) FROM memory_relations WHERE item_id = '{office}'");
    assert_eq!(app.db.count(&held).await, 0);
    assert_eq!(id_of(&fact(&app, &bob, agent_fact).await), office);
    assert_eq!(fact(&app, &ann, linked).await.status, 200, "its writer adds relations");
    assert_eq!(app.db.count(&held).await, 1);
}

/// A single scope holds what its class holds: `agent` what the agent's other users shared with
/// it and `tenant` what others shared with the tenant, never the caller's own facts, which
/// `user` (and `any`, once) holds.
#[tokio::test]
async fn a_single_scope_never_holds_the_callers_own_facts() {
    let (app, _provider) = app().await;
    let ann = principal("acme", Some("ann"), Some("helper"), None);
    let bob = principal("acme", Some("bob"), Some("helper"), None);
    let anns = id_of(&fact(&app, &ann, json!({"scope": "user", "content": "zebra ann", "visibility": "agent"})).await);
    let bobs = id_of(&fact(&app, &bob, json!({"scope": "user", "content": "zebra bob", "visibility": "tenant"})).await);
    embed_like_the_provider(&app.db.store(), MODEL, DIMS).await;
    let client = &app.client;
    let recall = |who: &Principal, scope: &str| {
        let body = json!({"query": "zebra", "scope": scope, "top_k": 20});
        let token = token(who);
        async move {
            let reply = client.post("/v1/recall", Some(&token), &body).await;
            assert_eq!(reply.status, 200, "{:?}", reply.body);
            let mut ids: Vec<Uuid> = reply.body["items"]
                .as_array()
                .expect("items")
                .iter()
                .map(|i| i["id"].as_str().and_then(|s| s.parse().ok()).expect("id"))
                .collect();
            ids.sort();
            ids
        }
    };
    let sorted = |mut ids: Vec<Uuid>| {
        ids.sort();
        ids
    };
    assert_eq!(recall(&ann, "agent").await, [bobs], "ann's own fact is not in her agent's scope");
    assert_eq!(recall(&bob, "agent").await, [anns]);
    assert_eq!(recall(&ann, "tenant").await, [bobs], "bob shared it with the tenant");
    assert_eq!(recall(&bob, "tenant").await, Vec::<Uuid>::new(), "bob's own fact is not in the tenant scope for him");
    assert_eq!(recall(&ann, "user").await, [anns]);
    assert_eq!(recall(&ann, "any").await, sorted(vec![anns, bobs]));
    let carl = principal("acme", Some("carl"), Some("coach"), None);
    assert_eq!(recall(&carl, "tenant").await, [bobs], "shared with the tenant: carl, of another agent, reads it");
}

/// What one written fact is, for the reference model of who may read it.
#[derive(Debug, Clone)]
struct Written {
    tenant: &'static str,
    scope: &'static str,
    user: &'static str,
    agent: Option<&'static str>,
    visibility: &'static str,
    roles: Vec<&'static str>,
}

impl Written {
    /// Whether `who`'s roles open it: a user's own memory is always open to that user.
    fn roles_open(&self, who: &Principal) -> bool {
        let is_user = who.user.as_ref().is_some_and(|u| u.as_str() == self.user);
        self.roles.is_empty()
            || who.roles.iter().any(|r| self.roles.contains(&r.as_str()))
            || (self.scope == "user" && is_user)
    }

    /// README's access-control table, as a function.
    fn readable_by(&self, who: &Principal) -> bool {
        let roles_ok = self.roles_open(who);
        let is_user = who.user.as_ref().is_some_and(|u| u.as_str() == self.user);
        let same_agent = self.agent.is_some() && who.agent.as_ref().map(|a| a.as_str()) == self.agent;
        let owner = match self.scope {
            "user" => is_user,
            _ => same_agent,
        };
        let shared = match self.visibility {
            "tenant" => true,
            "agent" => same_agent,
            _ => false,
        };
        who.tenant.as_str() == self.tenant && roles_ok && (owner || shared)
    }
}

/// Randomized: facts of random scope, visibility and roles by random writers; every reader sees
/// exactly what the table allows, through every class, with no row in two classes; deletes and
/// recall answers follow the same rule. Removing the visibility condition from the agent class
/// of the search SQL (`m.visibility <> 'private'`) makes it fail: other users' private facts
/// reach everyone of their agent.
#[tokio::test]
async fn visibility_and_roles_decide_who_reads_under_random_traffic() {
    let seed: u64 = rand::rng().random();
    println!("seed {seed}");
    let mut rng = StdRng::seed_from_u64(seed);
    let (app, _provider) = app().await;
    let tenants = ["acme", "globex"];
    let users = ["u1", "u2", "u3"];
    let agents = ["a1", "a2"];
    let roles = ["admin", "editor", "coach"];
    let mut written: HashMap<Uuid, Written> = HashMap::new();
    for i in 0..160 {
        let tenant = *tenants.choose(&mut rng).expect("tenant");
        let user = *users.choose(&mut rng).expect("user");
        let agent = rng.random_bool(0.8).then(|| *agents.choose(&mut rng).expect("agent"));
        let scope = if agent.is_some() && rng.random_bool(0.3) { "agent" } else { "user" };
        let visibility = match (scope, agent.is_some(), rng.random_range(0..3)) {
            ("agent", _, 0) | ("agent", _, 1) => "agent",
            (_, _, 2) => "tenant",
            ("user", true, 1) => "agent",
            _ => "private",
        };
        let visibility = if scope == "agent" && visibility == "private" { "agent" } else { visibility };
        let allowed: Vec<&str> = if rng.random_bool(0.3) {
            roles.iter().copied().filter(|_| rng.random_bool(0.5)).collect()
        } else {
            Vec::new()
        };
        // An agent's fact restricted to roles is written by a token holding them.
        let writer =
            with_roles(principal(tenant, Some(user), agent, None), if scope == "agent" { &allowed } else { &[] });
        let body = json!({
            "scope": scope, "content": format!("zebra note {i}"), "visibility": visibility, "allowed_roles": allowed,
        });
        let reply = fact(&app, &writer, body).await;
        written.insert(id_of(&reply), Written { tenant, scope, user, agent, visibility, roles: allowed });
    }
    embed_like_the_provider(&app.db.store(), MODEL, DIMS).await;

    let store = app.db.store();
    let search = store.search(MODEL, DIMS);
    let mut seen_any = 0;
    for _ in 0..120 {
        let tenant = *tenants.choose(&mut rng).expect("tenant");
        let user = rng.random_bool(0.7).then(|| *users.choose(&mut rng).expect("user"));
        let agent = rng.random_bool(0.7).then(|| *agents.choose(&mut rng).expect("agent"));
        let held: Vec<&str> = roles.iter().copied().filter(|_| rng.random_bool(0.3)).collect();
        let who = with_roles(principal(tenant, user, agent, None), &held);
        let classes = RecallScope::Any.classes(&who).expect("classes");
        let scope = SearchScope {
            tenant: &who.tenant,
            classes: &classes,
            kinds: &[],
            include_superseded: false,
            roles: &who.roles,
            user: who.user.as_ref(),
        };
        let ranked = search.keyword(&scope, "zebra", &CommonLexemes::default(), 1000).await.expect("keyword");
        let mut found: HashSet<Uuid> = HashSet::new();
        for ids in ranked.values() {
            for id in ids {
                assert!(found.insert(*id), "row {id} is in two classes for {who:?} (seed {seed})");
            }
        }
        let expected: HashSet<Uuid> = written.iter().filter(|(_, w)| w.readable_by(&who)).map(|(id, _)| *id).collect();
        for id in &found {
            assert!(expected.contains(id), "{:?} was read by {who:?} (seed {seed})", written[id]);
        }
        for id in &expected {
            assert!(found.contains(id), "{:?} was hidden from {who:?} (seed {seed})", written[id]);
        }
        seen_any += found.len();

        // The HTTP answer holds only readable rows.
        let reply = app.client.post("/v1/recall", Some(&token(&who)), &json!({"query": "zebra", "top_k": 20})).await;
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        for item in reply.body["items"].as_array().expect("items") {
            let id: Uuid = item["id"].as_str().and_then(|s| s.parse().ok()).expect("id");
            assert!(expected.contains(&id), "recall answered {:?} to {who:?} (seed {seed})", written[&id]);
            // A user's fact's ref names its writer: another reader gets one by the row's id.
            let w = &written[&id];
            let source_ref = item["source_ref"].as_str().expect("source_ref");
            if w.scope == "user" && user != Some(w.user) {
                assert_eq!(source_ref, format!("fact:user:{id}"), "(seed {seed})");
            } else if w.scope == "user" {
                assert!(source_ref.starts_with(&format!("fact:user:{}:", w.user)), "{source_ref} (seed {seed})");
            } else {
                // An agent's or tenant's fact names no user: every reader gets the ref its writes
                // produce.
                assert!(source_ref.starts_with(&format!("fact:{}:", w.scope)), "{source_ref} (seed {seed})");
                assert_ne!(source_ref, format!("fact:{}:{id}", w.scope), "(seed {seed})");
            }
        }
    }
    assert!(seen_any > 300, "the readers found too little to prove anything: {seen_any}");

    // Deletes: a user's token deletes its own rows that its roles open; a service token any
    // row its roles open; a token bound to a session without a user only rows of that session
    // (facts have none).
    let ids: Vec<Uuid> = written.keys().copied().collect();
    for id in ids.choose_multiple(&mut rng, 40) {
        let w = &written[id];
        let user = rng.random_bool(0.6).then(|| *users.choose(&mut rng).expect("user"));
        let session = (user.is_none() && rng.random_bool(0.4)).then_some("s1");
        let held: Vec<&str> = roles.iter().copied().filter(|_| rng.random_bool(0.4)).collect();
        let who = with_roles(principal(w.tenant, user, None, session), &held);
        let allowed = w.roles_open(&who) && user.is_none_or(|u| u == w.user) && session.is_none();
        let reply = app.client.delete(&format!("/v1/memories/{id}"), Some(&token(&who))).await;
        assert_eq!(reply.status, if allowed { 200 } else { 404 }, "{w:?} deleted by {who:?} (seed {seed})");
        let gone = format!("SELECT count(*) FROM memory_items WHERE id = '{id}' AND deleted_at IS NOT NULL");
        let gone = app.db.count(&gone).await;
        assert_eq!(gone, i64::from(allowed), "{w:?}, {who:?}: the row's state is not the answer's (seed {seed})");
    }
    // A token bound to a session deletes that session's messages, and no other session's.
    let message = |session: &str| {
        let writer = principal("acme", None, None, Some(session));
        let body = json!({"source_kind": "chat_message", "source_ref": format!("m-{session}"), "content": "hi"});
        let client = &app.client;
        async move { id_of(&client.post("/v1/memories", Some(&token(&writer)), &body).await) }
    };
    let (own, other) = (message("s1").await, message("s2").await);
    let s1 = token(&principal("acme", None, None, Some("s1")));
    assert_eq!(app.client.delete(&format!("/v1/memories/{other}"), Some(&s1)).await.status, 404);
    assert_eq!(app.client.delete(&format!("/v1/memories/{own}"), Some(&s1)).await.status, 200);
}

/// Each signal moves rows its way, and a row passes another only when their fused scores were
/// within the factor's bounds of each other: the same rows and queries ranked with the signals
/// off and on.
#[tokio::test]
async fn signals_move_ranking_within_their_bound() {
    let seed: u64 = rand::rng().random();
    println!("seed {seed}");
    let mut rng = StdRng::seed_from_u64(seed);
    let (app, provider) = app().await;
    let ann = principal("acme", Some("ann"), None, None);
    let typed = |content: &str, weight: f64| json!({"scope": "user", "content": content, "importance": weight, "confidence": weight});
    let low = id_of(&fact(&app, &ann, typed("ann parks at gate one", 0.0)).await);
    let high = id_of(&fact(&app, &ann, typed("ann parks at gate two", 1.0)).await);
    let words = ["harbor", "lantern", "violin", "orchard", "quartz", "meadow"];
    for i in 0..40 {
        let text: Vec<&str> = (0..3).map(|_| *words.choose(&mut rng).expect("word")).collect();
        let mut body = json!({"scope": "user", "content": format!("{} {i}", text.join(" "))});
        if rng.random_bool(0.7) {
            body["importance"] = json!(rng.random_range(0.0..=1.0));
            body["confidence"] = json!(rng.random_range(0.0..=1.0));
        }
        let days = rng.random_range(0..400);
        body["event_time"] = json!((chrono::Utc::now() - chrono::Duration::days(days)).to_rfc3339());
        id_of(&fact(&app, &ann, body).await);
    }
    embed_like_the_provider(&app.db.store(), MODEL, DIMS).await;

    // Equally relevant: the important, confident one first.
    let reply = app.client.post("/v1/recall", Some(&token(&ann)), &json!({"query": "ann parks at the gate"})).await;
    let ids: Vec<&str> =
        reply.body["items"].as_array().expect("items").iter().filter_map(|i| i["id"].as_str()).collect();
    let at = |id: Uuid| ids.iter().position(|i| *i == id.to_string()).unwrap_or(usize::MAX);
    assert!(at(high) < at(low), "{:?}", reply.body);

    let settings = ServerSettings::from_env(&server_env(&app.db.url, &provider.env(MODEL))).expect("settings");
    let embed = settings.embed.clone();
    let make = |signals: SignalWeights| {
        Recall::new(
            app.db.store(),
            Arc::new(LazyEmbedder::new(embed.clone())),
            None,
            RecallSettings { signals, ..RecallSettings::default() },
        )
    };
    let weights = RecallSettings::default().signals;
    let (off, on) = (make(SignalWeights::OFF), make(weights));
    let (lowest, highest) = weights.bounds();
    let mut flips = 0;
    for _ in 0..30 {
        let text: Vec<&str> = (0..2).map(|_| *words.choose(&mut rng).expect("word")).collect();
        let text = text.join(" ");
        let query = Query { text: &text, scope: RecallScope::Any, kinds: &[], shown: usize::MAX };
        let options = RecallOptions { query_vector: Some(unit_bag_of_words(&text, DIMS)), ..RecallOptions::default() };
        let fused: HashMap<Uuid, f64> =
            off.ranked(&ann, &query, 200, &options).await.expect("off").items.iter().map(|i| (i.id, i.score)).collect();
        let ranked = on.ranked(&ann, &query, 20, &options).await.expect("on").items;
        for (i, above) in ranked.iter().enumerate() {
            for below in &ranked[i + 1..] {
                let (a, b) = (fused[&above.id], fused[&below.id]);
                if a < b {
                    flips += 1;
                    assert!(b / a <= highest / lowest + 1e-9, "passed a row {:.3}x above it (seed {seed})", b / a);
                }
            }
        }
    }
    assert!(flips > 0, "the signals never moved a row (seed {seed})");
}

#[tokio::test]
async fn recall_records_access_through_an_idempotent_job_and_never_writes_itself() {
    let (app, _provider) = app().await;
    let ann = principal("acme", Some("ann"), None, None);
    let id = id_of(&fact(&app, &ann, json!({"scope": "user", "content": "ann keeps bees"})).await);
    embed_like_the_provider(&app.db.store(), MODEL, DIMS).await;
    for _ in 0..3 {
        let reply = app.client.post("/v1/recall", Some(&token(&ann)), &json!({"query": "bees"})).await;
        assert_eq!(reply.status, 200);
    }
    let untouched: (Option<chrono::DateTime<chrono::Utc>>, i32) =
        sqlx::query_as("SELECT last_accessed_at, access_count FROM memory_items WHERE id = $1")
            .bind(id)
            .fetch_one(&app.db.pool)
            .await
            .expect("row");
    assert_eq!(untouched, (None, 0), "the recall statement wrote");
    // The tracker queues one job per tenant within a second or so.
    let mut jobs: Vec<AccessJob> = Vec::new();
    for _ in 0..50 {
        let payloads: Vec<Vec<u8>> = sqlx::query_scalar("SELECT job FROM apalis.jobs WHERE job_type = 'access'")
            .fetch_all(&app.db.pool)
            .await
            .expect("jobs");
        jobs = payloads.iter().map(|p| serde_json::from_slice(p).expect("job")).collect();
        if jobs.iter().map(|j| j.items.len()).sum::<usize>() >= 3 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(jobs.iter().map(|j| j.items.len()).sum::<usize>(), 3, "{jobs:?}");
    let store = app.db.store();
    for job in &jobs {
        store.apply_access(job).await.expect("apply");
        assert_eq!(store.apply_access(job).await.expect("again"), 0, "a retried job counted twice");
    }
    let count: i32 = sqlx::query_scalar("SELECT access_count FROM memory_items WHERE id = $1")
        .bind(id)
        .fetch_one(&app.db.pool)
        .await
        .expect("row");
    assert_eq!(count, 3);

    // A job still waiting (every worker down for more than a day, say; here queued again to run
    // later, after a failure that came once its batch had committed) keeps its batch known past
    // the day: run again, it counts nothing twice. Once done, the batch is forgotten.
    sqlx::query("UPDATE access_batches SET applied_at = now() - interval '2 days'")
        .execute(&app.db.pool)
        .await
        .expect("age");
    sqlx::query(
        "UPDATE apalis.jobs SET run_at = now() + interval '1 hour',
             job = convert_to(jsonb_set(convert_from(job, 'UTF8')::jsonb, '{at}',
                                        to_jsonb(now() - interval '3 days'))::text, 'UTF8')
         WHERE job_type = 'access'",
    )
    .execute(&app.db.pool)
    .await
    .expect("accessed three days ago, due in an hour");
    assert_eq!(store.prune_access_batches().await.expect("prune"), 0, "the batch of a job not done was forgotten");
    assert_eq!(store.apply_access(&jobs[0]).await.expect("again"), 0);
    sqlx::query("UPDATE apalis.jobs SET status = 'Done' WHERE job_type = 'access'")
        .execute(&app.db.pool)
        .await
        .expect("done");
    assert!(store.prune_access_batches().await.expect("prune") > 0);

    // A count at the column's largest value stays there, and the batch still applies.
    sqlx::query("UPDATE memory_items SET access_count = 2147483647 WHERE id = $1")
        .bind(id)
        .execute(&app.db.pool)
        .await
        .expect("set");
    let again = mnemo_store::queue::AccessJob { batch: uuid::Uuid::now_v7(), ..jobs[0].clone() };
    store.apply_access(&again).await.expect("a count at its largest still applies");
    let count: i32 = sqlx::query_scalar("SELECT access_count FROM memory_items WHERE id = $1")
        .bind(id)
        .fetch_one(&app.db.pool)
        .await
        .expect("row");
    assert_eq!(count, i32::MAX);
}

/// Access bookkeeping gives way to the writes it could deadlock with: it does not wait on a
/// write whose foreign key names a row (a relation holds a key-share lock), and a row another
/// transaction holds for update (the judge retiring it) fails the batch at once, to be retried,
/// instead of waiting into PostgreSQL's deadlock check, which could abort the other side.
#[tokio::test]
async fn access_bookkeeping_gives_way_to_writes_and_the_judge() {
    let (app, _provider) = app().await;
    let ann = principal("acme", Some("ann"), None, None);
    let id = id_of(&fact(&app, &ann, json!({"scope": "user", "content": "ann keeps bees"})).await);
    let store = app.db.store();
    let job = |id| AccessJob {
        tenant_id: mnemo_core::TenantId::parse("acme").expect("tenant"),
        batch: uuid::Uuid::now_v7(),
        items: vec![id],
        at: chrono::Utc::now(),
    };
    let hold = |lock: &'static str| {
        let pool = app.db.pool.clone();
        async move {
            let mut tx = pool.begin().await.expect("begin");
            let sql = format!("SELECT 1 FROM memory_items WHERE id = $1 {lock}");
            sqlx::query(sqlx::AssertSqlSafe(sql)).bind(id).execute(&mut *tx).await.expect("lock");
            tx
        }
    };
    let five_s = std::time::Duration::from_secs(5);

    let key_share = hold("FOR KEY SHARE").await;
    let first = job(id);
    let applied = tokio::time::timeout(five_s, store.apply_access(&first)).await.expect("waited on a key-share lock");
    assert_eq!(applied.expect("applied"), 1);
    key_share.rollback().await.expect("release");

    let judge = hold("FOR UPDATE").await;
    let started = std::time::Instant::now();
    let second = job(id);
    let refused = tokio::time::timeout(five_s, store.apply_access(&second)).await.expect("waited on the judge's lock");
    assert!(refused.is_err() && started.elapsed() < std::time::Duration::from_millis(900), "{refused:?}");
    judge.rollback().await.expect("release");
    let count: i32 = sqlx::query_scalar("SELECT access_count FROM memory_items WHERE id = $1")
        .bind(id)
        .fetch_one(&app.db.pool)
        .await
        .expect("row");
    assert_eq!(count, 1, "the batch that gave way changed nothing");
}

#[tokio::test]
async fn a_copy_the_judge_retires_leaves_its_session_to_the_survivor_which_is_promoted() {
    let (app, _provider) = app().await;
    let store = app.db.store();
    let in_session = |s: &str| principal("acme", Some("ann"), Some("helper"), Some(s));
    let episodic = |content: &str| json!({"scope": "user", "content": content, "layer": "episodic", "confidence": 0.9});
    let policy = mnemo_jobs::JudgePolicy {
        batch_size: 10,
        max_wait: std::time::Duration::from_millis(5),
        topk: 5,
        threshold: 0.7,
    };
    let settle = || async {
        embed_like_the_provider(&store, MODEL, DIMS).await;
        mnemo_jobs::judge_pending(&store, None, policy, "test").await.expect("judge");
    };
    let first = id_of(&fact(&app, &in_session("s1"), episodic("Ann runs on Sundays.")).await);
    settle().await;
    let again = id_of(&fact(&app, &in_session("s2"), episodic("ann runs on sundays")).await);
    settle().await;
    let superseded_by: Option<Uuid> = sqlx::query_scalar("SELECT superseded_by FROM memory_items WHERE id = $1")
        .bind(first)
        .fetch_one(&app.db.pool)
        .await
        .expect("row");
    assert_eq!(superseded_by, Some(again), "the same words, retired without a model");

    assert_eq!(store.promote_episodic(0.75, 100).await.expect("promote"), 1, "stated in two sessions");
    let layer: String = sqlx::query_scalar("SELECT layer FROM memory_items WHERE id = $1")
        .bind(again)
        .fetch_one(&app.db.pool)
        .await
        .expect("layer");
    assert_eq!(layer, "semantic");
}

/// Memories written before the fingerprint kept signs hold the one without: computed again, a
/// "-18" stated in two sessions is promoted, and a "18" is not one of its sightings.
#[tokio::test]
async fn fingerprints_written_before_signs_counted_are_computed_again() {
    let (app, _provider) = app().await;
    let store = app.db.store();
    let in_session = |s: &str| principal("acme", Some("ann"), Some("helper"), Some(s));
    let episodic = |content: &str| json!({"scope": "user", "content": content, "layer": "episodic", "confidence": 0.9});
    let cold = id_of(&fact(&app, &in_session("s1"), episodic("The freezer is set to -18 C.")).await);
    let warm = id_of(&fact(&app, &in_session("s2"), episodic("The freezer is set to 18 C")).await);
    let again = id_of(&fact(&app, &in_session("s3"), episodic("the freezer is set to -18 c")).await);
    fact(&app, &in_session("s4"), episodic("Ann runs on Sundays.")).await;
    // As written before: the sign dropped.
    sqlx::query("UPDATE memory_items SET fingerprint = $1 WHERE id = $2")
        .bind(mnemo_core::fingerprint("The freezer is set to 18 C"))
        .bind(cold)
        .execute(&app.db.pool)
        .await
        .expect("old fingerprint");
    let (read, changed) = store.refingerprint(None, 2, &mut |_, _| {}).await.expect("refingerprint");
    assert_eq!((read, changed), (2, 1), "only memories with a minus before a digit are read");
    assert_eq!(store.refingerprint(None, 2, &mut |_, _| {}).await.expect("again"), (2, 0), "idempotent");
    assert_eq!(store.promote_episodic(0.75, 100).await.expect("promote"), 2, "-18 in two sessions");
    let layer = |id: Uuid| layer_of(&app, id);
    assert_eq!(
        (layer(cold).await, layer(again).await, layer(warm).await),
        ("semantic".into(), "semantic".into(), "episodic".into())
    );
}

#[tokio::test]
async fn episodic_memories_seen_in_two_sessions_are_promoted_once_and_old_ones_fade_then_are_forgotten() {
    let (app, _provider) = app().await;
    let store = app.db.store();
    let in_session = |s: &str| principal("acme", Some("ann"), Some("helper"), Some(s));
    let episodic = |content: &str, confidence: f64| json!({"scope": "user", "content": content, "layer": "episodic", "confidence": confidence});
    // Seen in two sessions (the words alike, case and punctuation aside), confident.
    let a = id_of(&fact(&app, &in_session("s1"), episodic("Ann runs on Sundays.", 0.9)).await);
    let b = id_of(&fact(&app, &in_session("s2"), episodic("ann runs on sundays", 0.8)).await);
    // Seen in two sessions but unsure; seen twice in one session.
    let unsure = id_of(&fact(&app, &in_session("s1"), episodic("Ann might like jazz", 0.5)).await);
    fact(&app, &in_session("s2"), episodic("Ann might like jazz", 0.5)).await;
    let once = id_of(&fact(&app, &in_session("s1"), episodic("Ann swims", 0.9)).await);
    fact(&app, &in_session("s1"), episodic("Ann swims", 0.9)).await;

    // Seen in two sessions by different readers: each reader saw it once.
    let shared = json!({"scope": "user", "content": "Ann flies kites", "layer": "episodic", "confidence": 0.9,
                        "visibility": "agent"});
    id_of(&fact(&app, &in_session("s1"), shared).await);
    id_of(&fact(&app, &in_session("s2"), episodic("ann flies kites", 0.9)).await);

    // One group a run: its rows are promoted together.
    assert_eq!(store.promote_episodic(0.75, 1).await.expect("promote"), 2);
    assert_eq!(store.promote_episodic(0.75, 100).await.expect("again"), 0, "promotion is not idempotent");
    let layer = |id: Uuid| layer_of(&app, id);
    assert_eq!((layer(a).await, layer(b).await), ("semantic".into(), "semantic".into()));
    assert_eq!((layer(unsure).await, layer(once).await), ("episodic".into(), "episodic".into()));
    let audited = app.db.count("SELECT count(*) FROM audit_log WHERE event = 'memory.promote'").await;
    assert_eq!(audited, 2);

    // Fading: an episodic memory dated long ago leaves packs but stays recallable.
    let old = json!({"scope": "user", "content": "ann visited the glacier museum", "layer": "episodic",
                     "event_time": "2020-01-01T00:00:00Z"});
    let old = id_of(&fact(&app, &in_session("s3"), old).await);
    embed_like_the_provider(&store, MODEL, DIMS).await;
    let before = chrono::Utc::now() - chrono::Duration::days(130);
    assert_eq!(store.fade_episodic(before, 100).await.expect("fade"), 1);
    assert_eq!(store.fade_episodic(before, 100).await.expect("again"), 0, "fading is not idempotent");
    // One dated ahead (a booking) decays from its write, not from its date.
    let ahead = json!({"scope": "user", "content": "ann booked the glacier tour", "layer": "episodic",
                       "event_time": "2999-01-01T00:00:00Z"});
    let ahead = id_of(&fact(&app, &in_session("s4"), ahead).await);
    assert_eq!(store.fade_episodic(before, 100).await.expect("fade"), 0, "written just now");
    sqlx::query("UPDATE memory_items SET created_at = now() - interval '200 days' WHERE id = $1")
        .bind(ahead)
        .execute(&app.db.pool)
        .await
        .expect("written long ago");
    assert_eq!(store.fade_episodic(before, 100).await.expect("fade"), 1, "dated ahead, written long ago");
    let ann = in_session("s3");
    let pack = app.client.post("/v1/memory-pack", Some(&token(&ann)), &json!({"query": "glacier museum"})).await;
    assert_eq!(pack.status, 200, "{:?}", pack.body);
    assert!(!pack.body["rendered"].as_str().expect("text").contains("glacier"), "{:?}", pack.body);
    let recalled = app.client.post("/v1/recall", Some(&token(&ann)), &json!({"query": "glacier museum"})).await;
    let ids: Vec<&Value> = recalled.body["items"].as_array().expect("items").iter().map(|i| &i["id"]).collect();
    assert!(ids.contains(&&json!(old.to_string())), "{:?}", recalled.body);

    // Forgetting (MNEMO_DECAY_DELETE_FLOOR, off by default): maintenance deletes a faded memory
    // unused for longer still, with an audit row; a semantic one as old never fades, so stays.
    let born = json!({"scope": "user", "content": "ann was born by the glacier", "event_time": "2020-01-01T00:00:00Z"});
    let born = id_of(&fact(&app, &ann, born).await);
    let policy = mnemo_jobs::HousekeepingPolicy {
        signals: mnemo_config::SignalSettings { decay_delete_floor: 0.01, ..Default::default() },
        ..mnemo_testkit::housekeeping_policy(MODEL)
    };
    // Faded just now, it stays out of packs a while before it is deleted (from the fade floor to
    // the delete floor: 70 days at a 30-day half-life), however long ago it was last used.
    let (years_ago, weeks_ago) =
        (chrono::Utc::now() - chrono::Duration::days(1000), chrono::Utc::now() - chrono::Duration::days(60));
    assert_eq!(store.forget_decayed(years_ago, weeks_ago, 100).await.expect("forget"), 0);
    sqlx::query("UPDATE memory_items SET faded_at = now() - interval '71 days' WHERE id = $1")
        .bind(old)
        .execute(&app.db.pool)
        .await
        .expect("faded long ago");
    mnemo_jobs::run_housekeeping(&store, "w", &policy).await.expect("housekeeping");
    assert_eq!(app.db.count("SELECT forgotten FROM maintenance_runs WHERE finished_at IS NOT NULL").await, 1);
    let deleted = |id: Uuid| {
        let pool = app.db.pool.clone();
        async move {
            sqlx::query_scalar::<_, bool>("SELECT deleted_at IS NOT NULL FROM memory_items WHERE id = $1")
                .bind(id)
                .fetch_one(&pool)
                .await
                .expect("row")
        }
    };
    assert_eq!((deleted(old).await, deleted(born).await), (true, false));
    let audit = format!(
        "SELECT count(*) FROM audit_log WHERE event = 'memory.delete' AND reason = 'decayed' AND item_id = '{old}'"
    );
    assert_eq!(app.db.count(&audit).await, 1);
    let recalled = app.client.post("/v1/recall", Some(&token(&ann)), &json!({"query": "glacier museum"})).await;
    let ids: Vec<&Value> = recalled.body["items"].as_array().expect("items").iter().map(|i| &i["id"]).collect();
    assert!(!ids.contains(&&json!(old.to_string())) && ids.contains(&&json!(born.to_string())), "{:?}", recalled.body);

    // Said again by its user, a forgotten memory comes back unfaded, and stays through the next
    // forgetting; so does a faded one said again while live.
    let again = json!({"scope": "user", "content": "ann visited the glacier museum", "layer": "episodic",
                       "event_time": "2020-01-01T00:00:00Z"});
    assert_eq!(id_of(&fact(&app, &in_session("s3"), again).await), old);
    let again = json!({"scope": "user", "content": "ann booked the glacier tour", "layer": "episodic",
                       "event_time": "2999-01-01T00:00:00Z"});
    assert_eq!(id_of(&fact(&app, &in_session("s4"), again).await), ahead);
    let faded = |id: Uuid| format!("SELECT count(*) FROM memory_items WHERE id = '{id}' AND faded_at IS NOT NULL");
    assert_eq!((app.db.count(&faded(old)).await, app.db.count(&faded(ahead)).await), (0, 0));
    assert_eq!(store.forget_decayed(years_ago, weeks_ago, 100).await.expect("forget"), 0);
    assert!(!deleted(old).await);
}

/// A fact deleted before its embed job ran (which passed it over) and said again by its user is
/// embedded: its revival queues an embed job.
#[tokio::test]
async fn a_fact_deleted_before_it_was_embedded_and_said_again_is_embedded() {
    let (app, _provider) = app().await;
    let ann = principal("acme", Some("ann"), Some("helper"), None);
    let body = json!({"scope": "user", "content": "Ann lives in Lyon"});
    let id = id_of(&fact(&app, &ann, body.clone()).await);
    assert_eq!(app.client.delete(&format!("/v1/memories/{id}"), Some(&token(&ann))).await.status, 200);
    // Its job ran meanwhile, and found the row deleted.
    sqlx::query("DELETE FROM apalis.jobs WHERE job_type = 'embed'").execute(&app.db.pool).await.expect("the job ran");
    assert_eq!(id_of(&fact(&app, &ann, body).await), id);
    let queued = format!(
        "SELECT count(*) FROM apalis.jobs, jsonb_array_elements(convert_from(job, 'UTF8')::jsonb->'items') AS i
         WHERE job_type = 'embed' AND i->>'item_id' = '{id}'"
    );
    assert_eq!(app.db.count(&queued).await, 1, "a live fact with no embed job");
}

/// Random budgets and limits over rows of every layer: the rendered pack never passes the max
/// budget, passes the soft one only for the best item of a layer otherwise missing, and no
/// layer brings more than its top k.
#[tokio::test]
async fn packs_keep_their_budgets_and_layer_limits() {
    let seed: u64 = rand::rng().random();
    println!("seed {seed}");
    let mut rng = StdRng::seed_from_u64(seed);
    let (app, _provider) = app().await;
    let ann = principal("acme", Some("ann"), Some("helper"), Some("s1"));
    let words = ["kayak", "river", "paddle", "camp", "tent", "stove", "map", "rope"];
    for i in 0..60 {
        let text: Vec<&str> = (0..rng.random_range(3..40)).map(|_| *words.choose(&mut rng).expect("w")).collect();
        let content = format!("{} {i}", text.join(" "));
        let reply = match i % 4 {
            0 => {
                let body = json!({"source_kind": "chat_message", "source_ref": format!("m{i}"), "content": content});
                app.client.post("/v1/memories", Some(&token(&ann)), &body).await
            }
            1 => fact(&app, &ann, json!({"scope": "user", "content": content, "layer": "episodic"})).await,
            2 => fact(&app, &ann, json!({"scope": "user", "content": content})).await,
            _ => fact(&app, &ann, json!({"scope": "agent", "content": content, "layer": "procedural"})).await,
        };
        id_of(&reply);
    }
    embed_like_the_provider(&app.db.store(), MODEL, DIMS).await;
    let counter = mnemo_models::Tokenizer::new(ContextSettings::default().tokenizer);
    for _ in 0..25 {
        let soft = rng.random_range(20..400u32);
        let max = soft + rng.random_range(0..300u32);
        let top_k = [rng.random_range(0..5), rng.random_range(0..5), rng.random_range(0..5), rng.random_range(0..5)];
        let body = json!({
            "query": "kayak river camp", "soft_budget_tokens": soft, "max_budget_tokens": max,
            "top_k": {"working": top_k[0], "episodic": top_k[1], "semantic": top_k[2], "procedural": top_k[3]},
        });
        let reply = app.client.post("/v1/memory-pack", Some(&token(&ann)), &body).await;
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        let rendered = reply.body["rendered"].as_str().expect("rendered");
        let tokens = counter.count(rendered);
        assert_eq!(json!(tokens), reply.body["diagnostics"]["tokens"], "{body}");
        assert!(tokens <= max, "{tokens} tokens past the max {max} (seed {seed})");
        let layers = &reply.body["diagnostics"]["layers"];
        for (i, name) in ["working", "episodic", "semantic", "procedural"].iter().enumerate() {
            let items = layers[name]["items"].as_u64().expect("items");
            assert!(items <= top_k[i], "{name}: {items} items past its top k {} (seed {seed})", top_k[i]);
        }
        // Past the soft budget only by the best item of a layer otherwise missing.
        let soft_phase = reply.body["diagnostics"]["soft_phase_tokens"].as_u64().expect("soft phase");
        assert!(soft_phase <= u64::from(soft), "{soft_phase} tokens before the exceptions (seed {seed})");
        let items = reply.body["items"].as_array().expect("items");
        for late in items.iter().filter(|i| i["past_soft_budget"] == json!(true)) {
            let layer = &late["pack_layer"];
            let alone = items.iter().filter(|i| &i["pack_layer"] == layer).count() == 1;
            assert!(alone, "an item past the soft budget shares its layer (seed {seed})");
        }
        if items.iter().all(|i| i["past_soft_budget"] == json!(false)) {
            assert!(tokens <= soft, "{tokens} tokens past the soft budget {soft} without exceptions (seed {seed})");
        }
        if !rendered.is_empty() {
            assert!(rendered.starts_with("# Memory\n"), "{rendered}");
        }
    }
    // The defaults render the seed's format.
    let reply = app.client.post("/v1/memory-pack", Some(&token(&ann)), &json!({"query": "kayak"})).await;
    let rendered = reply.body["rendered"].as_str().expect("rendered");
    assert!(rendered.contains("## Working Memory\n- ") && rendered.contains("## Procedural Memory\n- "), "{rendered}");
    let bad =
        app.client.post("/v1/memory-pack", Some(&token(&ann)), &json!({"query": "x", "soft_budget_tokens": 0})).await;
    assert_eq!((bad.status, bad.code()), (400, "invalid_field"));
    let bad = app
        .client
        .post(
            "/v1/memory-pack",
            Some(&token(&ann)),
            &json!({"query": "x", "soft_budget_tokens": 500, "max_budget_tokens": 100}),
        )
        .await;
    assert_eq!((bad.status, bad.code()), (400, "invalid_field"));

    // The context call places the pack with the workspace's notes: reference under a marker,
    // never in a system message.
    let context = app
        .client
        .post(
            "/v1/sessions/s1/context",
            Some(&token(&ann)),
            &json!({"current_message": "what about the kayak?", "memory_pack": {"max_budget_tokens": 300}}),
        )
        .await;
    assert_eq!(context.status, 200, "{:?}", context.body);
    let messages = context.body["messages"].as_array().expect("messages");
    let pack = context.body["diagnostics"]["memory_pack"]["items"].as_array().expect("items");
    assert!(!pack.is_empty(), "{:?}", context.body);
    let memory =
        messages.iter().find(|m| m["content"].as_str().is_some_and(|c| c.starts_with(mnemo_core::MEMORY_PREFIX)));
    assert!(
        memory.is_some_and(|m| m["role"] == "user" && m["content"].as_str().is_some_and(|c| c.contains("# Memory"))),
        "{messages:?}"
    );
    assert!(
        messages
            .iter()
            .filter(|m| m["role"] == "system")
            .all(|m| !m["content"].as_str().unwrap_or("").contains("# Memory")),
        "{messages:?}"
    );
    assert!(context.body["diagnostics"]["memory_pack"]["tokens"].as_u64().expect("tokens") <= 300);

    // A service token's working layer is the path's session, as the session's own token's is.
    let service = principal("acme", None, Some("helper"), None);
    let working = |session: &'static str| {
        let (app, service) = (&app, &service);
        async move {
            let body = json!({"current_message": "the kayak", "memory_pack": {"top_k": {"working": 3}}});
            let context =
                app.client.post(&format!("/v1/sessions/{session}/context"), Some(&token(service)), &body).await;
            assert_eq!(context.status, 200, "{:?}", context.body);
            let items = context.body["diagnostics"]["memory_pack"]["items"].as_array().cloned().unwrap_or_default();
            items.iter().filter(|i| i["layer"] == "working").count()
        }
    };
    assert_eq!(working("s1").await, 3);
    assert_eq!(working("s2").await, 0, "another session's messages");

    // A current message longer than a query may be (a paste) asks the pack with its end.
    let paste = format!("{}\nwhat about the kayak?", "é lorem ipsum ".repeat(400));
    assert!(paste.len() > mnemo_core::MAX_QUERY_BYTES);
    let context = app
        .client
        .post("/v1/sessions/s1/context", Some(&token(&ann)), &json!({"current_message": paste, "memory_pack": true}))
        .await;
    assert_eq!(context.status, 200, "{:?}", context.body);
    assert!(context.body["diagnostics"]["memory_pack"]["items"].as_array().is_some(), "{:?}", context.body);

    // A message that holds nothing to ask with leaves the pack out; one with a NUL asks without it.
    for (message, left_out) in [("", Some("no_query")), ("  \n ", Some("no_query")), ("the kayak\u{0}?", None)] {
        let body = json!({"current_message": message, "memory_pack": true});
        let context = app.client.post("/v1/sessions/s1/context", Some(&token(&ann)), &body).await;
        assert_eq!(context.status, 200, "{message:?}: {:?}", context.body);
        let pack = &context.body["diagnostics"]["memory_pack"];
        assert_eq!(pack["left_out"].as_str(), left_out, "{message:?}: {pack}");
    }
    // Left out or not, the pack's options are checked (schemathesis found these taken unread).
    for options in [json!({"soft_budget_tokens": [1]}), json!({"top_k": {"episodic": "x"}}), json!({"nonsense": 1})] {
        let body = json!({"current_message": "", "memory_pack": options});
        let context = app.client.post("/v1/sessions/s1/context", Some(&token(&ann)), &body).await;
        assert_eq!(context.status, 400, "{options}: {:?}", context.body);
    }
}

#[tokio::test]
async fn a_context_pack_leaves_out_the_notes_its_memory_part_places() {
    let (app, _provider) = app().await;
    let ann = principal("acme", Some("ann"), Some("helper"), Some("s1"));
    let today = chrono::Utc::now().date_naive(); // the tenant's zone is UTC
    let old_day = today - chrono::Days::new(30);
    for (path, content) in [
        ("MEMORY.md".to_owned(), "Ann keeps her kayak Bluebell in the boathouse."),
        (format!("memory/{today}.md"), "Ann paddled her kayak Daffodil upstream today."),
        (format!("memory/{old_day}.md"), "Ann sold her old kayak Marigold last month."),
    ] {
        let put = app
            .client
            .put(&format!("/v1/workspace/files/{path}"), Some(&token(&ann)), &json!({"content": content}))
            .await;
        assert!(matches!(put.status, 200 | 201), "{path}: {:?}", put.body);
    }
    embed_like_the_provider(&app.db.store(), MODEL, DIMS).await;
    let window = || async {
        let body = json!({"current_message": "Bluebell, Daffodil or Marigold: which kayak?", "memory_pack": true});
        let reply = app.client.post("/v1/sessions/s1/context", Some(&token(&ann)), &body).await;
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        reply.body["messages"]
            .as_array()
            .expect("messages")
            .iter()
            .filter_map(|m| m["content"].as_str())
            .collect::<String>()
    };
    // The memory part places MEMORY.md and today's note; the pack brings the older note alone.
    let text = window().await;
    for (name, times) in [("Bluebell", 1), ("Daffodil", 1), ("Marigold", 1)] {
        assert_eq!(text.matches(&format!("kayak {name}")).count(), times, "{name}: {text}");
    }
    // MEMORY.md disabled is in no prompt, the pack's included.
    let patch = app.client.patch("/v1/workspace/files/MEMORY.md", Some(&token(&ann)), &json!({"enabled": false})).await;
    assert_eq!(patch.status, 200, "{:?}", patch.body);
    let text = window().await;
    assert!(!text.contains("kayak Bluebell") && text.contains("kayak Marigold"), "{text}");
    // A MEMORY.md too long for the memory part is cut there: the pack may bring what the cut took.
    let patch = app.client.patch("/v1/workspace/files/MEMORY.md", Some(&token(&ann)), &json!({"enabled": true})).await;
    assert_eq!(patch.status, 200, "{:?}", patch.body);
    let filler = "a long paragraph about the weather and the garden. ".repeat(400);
    let long = format!("{filler}\n\nAnn keeps her kayak Bluebell in the boathouse.\n\n{filler}");
    let put = app.client.put("/v1/workspace/files/MEMORY.md", Some(&token(&ann)), &json!({"content": long})).await;
    assert_eq!(put.status, 200, "{:?}", put.body);
    embed_like_the_provider(&app.db.store(), MODEL, DIMS).await;
    let text = window().await;
    assert!(text.contains("characters cut to fit"), "the memory part is cut");
    assert_eq!(text.matches("kayak Bluebell").count(), 1, "{text}");
}

/// A tool output is read as its session's messages are: by a token bound to that session, the
/// user whose row it is (without a session), or a service token without a session.
#[tokio::test]
async fn tool_outputs_follow_the_session_rules() {
    let (app, _provider) = app().await;
    let writer = principal("acme", Some("ann"), None, Some("s1"));
    let payload = "x".repeat(20_000);
    let body = json!({"source_kind": "tool_output", "source_ref": "call-1", "content": payload});
    let reply = app.client.post("/v1/memories", Some(&token(&writer)), &body).await;
    assert_eq!(reply.status, 201, "{:?}", reply.body);
    let key: String = sqlx::query_scalar("SELECT tool_output_key FROM memory_items WHERE source_ref = 'call-1'")
        .fetch_one(&app.db.pool)
        .await
        .expect("key");
    let read = |who: Principal| {
        let (app, key) = (&app, &key);
        async move { app.client.get(&format!("/v1/tool-outputs/{key}"), Some(&token(&who))).await.status }
    };
    assert_eq!(read(writer.clone()).await, 200);
    assert_eq!(read(principal("acme", Some("ann"), None, None)).await, 200);
    assert_eq!(read(principal("acme", None, None, None)).await, 200);
    assert_eq!(read(principal("acme", None, None, Some("s2"))).await, 404, "a service token of another session");
    assert_eq!(read(principal("acme", Some("ann"), None, Some("s2"))).await, 404, "the user's other session");
    assert_eq!(read(principal("acme", Some("bob"), None, None)).await, 404, "another user");
    assert_eq!(read(principal("globex", None, None, None)).await, 404, "another tenant");
}
