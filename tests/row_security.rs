//! The second tenant wall: row-level security holds the API's role, so a statement that forgot
//! its tenant filter still sees one tenant's rows, and a connection nobody named a tenant on sees
//! none.

use mnemo_core::RecallClass;
use mnemo_store::{CommonLexemes, SearchScope, Store};
use mnemo_testkit::{TestApp, principal, token};
use serde_json::json;

/// Two tenants, each with a message in a session of the same name.
async fn two_tenants() -> TestApp {
    let app = TestApp::spawn().await;
    for tenant in ["acme", "globex"] {
        let token = token(&principal(tenant, None, None, Some("s1")));
        let body = json!({ "source_kind": "chat_message", "source_ref": "m-1", "content": format!("zebra crossing at {tenant}") });
        let reply = app.client.post("/v1/memories", Some(&token), &body).await;
        assert_eq!(reply.status, 201, "{:?}", reply.body);
    }
    app
}

#[tokio::test]
async fn a_search_without_its_tenant_filter_still_sees_only_its_tenant() {
    let app = two_tenants().await;
    let acme = principal("acme", None, None, Some("s1"));
    let classes = [RecallClass::Session(acme.session.clone().expect("session"))];
    let scope = SearchScope {
        tenant: &acme.tenant,
        classes: &classes,
        kinds: &[],
        include_superseded: false,
        roles: &[],
        user: None,
    };
    // Every tenant condition of the keyword statement, taken out.
    let unfiltered = |sql: &str| {
        let edited = ["m.tenant_id = $1", "t.tenant_id = $1", "f.tenant_id = $1"]
            .iter()
            .fold(sql.to_owned(), |sql, condition| sql.replace(condition, "true"))
            .replace("WHERE tenant_id = $1 AND", "WHERE");
        assert!(!edited.contains("tenant_id"), "a tenant condition is left in:\n{edited}");
        edited
    };
    let hits = |store: Store| {
        let scope = scope.clone();
        async move {
            let search = store.search("none", 4).with_keyword_sql(unfiltered);
            let ranked = search.keyword(&scope, "zebra", &CommonLexemes::default(), 10).await.expect("keyword");
            ranked.values().map(Vec::len).sum::<usize>()
        }
    };

    // As the owner, which row-level security does not hold, the edited statement crosses tenants:
    // it is the statement the wall must catch.
    assert_eq!(hits(app.db.store()).await, 2, "the edited statement should find both tenants' rows");
    // As the API's role, the wall holds.
    let api = Store::connect(&app.db.app_url, 2).await.expect("connect as the API's role");
    assert!(api.walled());
    assert_eq!(hits(api).await, 1, "row-level security let another tenant's row through");
}

#[tokio::test]
async fn a_connection_named_for_no_tenant_sees_no_rows() {
    let app = two_tenants().await;
    // One connection to name tenants on, so that each search below takes the same one.
    let api = Store::connect(&app.db.app_url, 1).await.expect("connect as the API's role");
    let session = principal("acme", None, None, Some("s1")).session.expect("session");
    let classes = [RecallClass::Session(session)];
    let mut found = Vec::new();
    for tenant in ["acme", "globex", "acme"] {
        let tenant = mnemo_core::TenantId::parse(tenant).expect("tenant");
        let scope = SearchScope {
            tenant: &tenant,
            classes: &classes,
            kinds: &[],
            include_superseded: false,
            roles: &[],
            user: None,
        };
        // Every tenant condition out, as in the test above: the named tenant alone decides.
        let search = api.search("none", 4).with_keyword_sql(|sql| {
            sql.replace("m.tenant_id = $1", "true").replace("WHERE tenant_id = $1 AND", "WHERE")
        });
        let ranked = search.keyword(&scope, "zebra", &CommonLexemes::default(), 10).await.expect("keyword");
        let ids: Vec<_> = ranked.into_values().flatten().collect();
        assert_eq!(ids.len(), 1, "{tenant}'s search saw {ids:?}");
        found.push(ids[0]);
    }
    assert_ne!(found[0], found[1], "the second search kept the first one's tenant");
    assert_eq!(found[0], found[2]);

    // The store's other connections, where no tenant is ever named, see no tenant's rows.
    let count = |sql: &'static str| {
        let pool = api.pool().clone();
        async move { sqlx::query_scalar::<_, i64>(sql).fetch_one(&pool).await.expect("count") }
    };
    assert_eq!(count("SELECT count(*) FROM memory_items").await, 0, "rows seen where no tenant was named");
    assert_eq!(count("SELECT count(*) FROM audit_log").await + count("SELECT count(*) FROM tool_outputs").await, 0);
    assert_eq!(app.db.count("SELECT count(*) FROM memory_items").await, 2, "the owner sees both");

    // Writing another tenant's row on a connection named for acme is refused.
    let mut conn = api.pool().acquire().await.expect("connection");
    sqlx::query("SELECT set_config('mnemo.tenants', '{acme}', false)").execute(&mut *conn).await.expect("set");
    let refused = sqlx::query("UPDATE memory_items SET importance = importance WHERE tenant_id = 'globex'")
        .execute(&mut *conn)
        .await
        .expect("update");
    assert_eq!(refused.rows_affected(), 0, "acme's connection updated globex's row");
    let insert = sqlx::query("INSERT INTO tenant_config (tenant_id, settings) VALUES ('globex', '{}')")
        .execute(&mut *conn)
        .await;
    let message = insert.expect_err("acme's connection wrote a row of globex").to_string();
    assert!(message.contains("row-level security"), "{message}");
}

#[tokio::test]
async fn the_api_role_is_refused_when_the_wall_would_not_hold_it() {
    let app = TestApp::spawn().await;
    let owner = app.db.store();
    let role: sqlx::postgres::PgConnectOptions = app.db.url.parse().expect("url");
    let refused = owner.grant_app_role(role.get_username()).await.expect_err("the owner was granted");
    assert!(refused.to_string().contains("row-level security would not hold it"), "{refused}");
    // The role, not the database URL, is what is wrong.
    assert!(!refused.to_string().contains("database URL"), "{refused}");
    assert!(owner.grant_app_role("no such role").await.is_err());
    // Granting again to the API's role changes nothing and succeeds.
    let app_role: sqlx::postgres::PgConnectOptions = app.db.app_url.parse().expect("url");
    owner.grant_app_role(app_role.get_username()).await.expect("granted again");
}

#[tokio::test]
async fn workers_and_the_runbook_refuse_the_api_role() {
    let db = mnemo_testkit::TestDb::new().await;
    // Their batches, housekeeping and operator commands cross tenants, which the wall would
    // hide from them: an empty answer would look like an empty database.
    let refused = mnemo_testkit::WorkerProcess::start::<&str>(&db.app_url, &[]).await;
    let message = refused.expect_err("a worker ran as the API's role").to_string();
    assert!(message.contains("exited"), "{message}");
    for args in [&["status"][..], &["audit", "--tenant", "acme"]] {
        let output = std::process::Command::new(mnemo_testkit::binary("mnemo-runbook").expect("runbook"))
            .args(args)
            .env_clear()
            .env(mnemo_config::vars::DATABASE_URL, &db.app_url)
            .output()
            .expect("runbook runs");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{args:?} ran as the API's role");
        assert!(stderr.contains("held by row-level security"), "{args:?}: {stderr}");
    }
}

#[tokio::test]
async fn the_runbook_migrates_an_empty_database_and_grants_the_api_role() {
    // What `make run` does on a fresh machine: an empty database, before any table has an owner.
    let (name, url) =
        mnemo_store::create_empty_database(&mnemo_testkit::admin_url(), "mnemo_test").await.expect("created");
    let app_url = std::env::var("MNEMO_APP_DATABASE_URL").expect("MNEMO_APP_DATABASE_URL (scripts/env.sh sets it)");
    let app_role: sqlx::postgres::PgConnectOptions = app_url.parse().expect("url");
    let runbook = |args: &[&str]| {
        let output = std::process::Command::new(mnemo_testkit::binary("mnemo-runbook").expect("runbook"))
            .args(args)
            .env_clear()
            .env(mnemo_config::vars::DATABASE_URL, &url)
            .output()
            .expect("runbook runs");
        let (stdout, stderr) = (String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
        assert!(output.status.success(), "{args:?}: {stderr}");
        stdout.into_owned()
    };
    assert!(runbook(&["migrate"]).contains("schema is current"));
    runbook(&["grant-app-role", app_role.get_username()]);
    // The second time there is nothing to do.
    assert!(runbook(&["migrate"]).contains("(0 migrations applied now)"));
    // The runbook's role owns the tables now; the wall holds the API's.
    assert!(!Store::connect(&url, 2).await.expect("owner").walled());
    assert!(Store::connect(&mnemo_store::with_database(&app_url, &name), 2).await.expect("API role").walled());
    // An autovacuum worker on it can refuse the drop; scripts/test.sh drops it next run then.
    let _ = mnemo_store::drop_database(&mnemo_testkit::admin_url(), &name).await;
}

#[tokio::test]
async fn every_table_with_a_tenant_is_walled() {
    let db = mnemo_testkit::TestDb::new().await;
    // A table a later migration adds with a tenant_id column, but without the policy, would be
    // open to a statement that forgets its tenant filter.
    let tables: Vec<(String, bool, Option<String>, Option<String>)> = sqlx::query_as(
        "SELECT c.relname::text, c.relrowsecurity, p.qual, p.with_check
         FROM pg_class c
         JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = current_schema()
         JOIN pg_attribute a ON a.attrelid = c.oid AND a.attname = 'tenant_id' AND NOT a.attisdropped
         LEFT JOIN pg_policies p ON p.schemaname = n.nspname AND p.tablename = c.relname
                                AND p.policyname = 'tenant_wall'
         WHERE c.relkind IN ('r', 'p')
         ORDER BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .expect("catalog");
    assert!(tables.len() >= 16, "{tables:?}");
    for (table, row_security, using, check) in tables {
        assert!(row_security, "{table}: row-level security is not enabled");
        let using = using.unwrap_or_else(|| panic!("{table} has no tenant_wall policy"));
        assert!(using.contains("tenant_id") && using.contains("mnemo_tenants()"), "{table}: USING {using}");
        assert_eq!(check.as_deref(), Some(using.as_str()), "{table}: WITH CHECK differs from USING");
    }
}

/// A chat message of `tenant`'s session s1.
fn message(tenant: &str, source_ref: &str) -> mnemo_core::NewMemory {
    mnemo_core::NewMemory::chat_message(
        &principal(tenant, None, None, Some("s1")),
        mnemo_core::SourceRef::parse(source_ref).expect("ref"),
        mnemo_core::MemoryText::parse(&format!("a message of {tenant}")).expect("text"),
        None,
        mnemo_core::Extras::default(),
    )
    .expect("row")
}

#[tokio::test]
async fn a_committer_keeping_its_connection_names_each_batch_s_tenants() {
    let db = mnemo_testkit::TestDb::new().await;
    let api = Store::connect(&db.app_url, 2).await.expect("connect as the API's role");
    let commits = mnemo_store::GroupCommit::start(api, 1, 64, std::time::Duration::from_secs(60));

    // One committer, so each write below reuses the connection the one before it named.
    for (n, tenant) in ["acme", "globex", "acme", "globex"].into_iter().enumerate() {
        let written = commits.remember(message(tenant, &format!("m-{n}"))).await;
        assert!(written.as_ref().is_ok_and(|w| w.was_new), "{tenant}'s write on the kept connection: {written:?}");
    }
    // A batch of both tenants, and one of acme alone after it.
    let mut both = tokio::task::JoinSet::new();
    for n in 0..8 {
        let commits = commits.clone();
        both.spawn(async move { commits.remember(message(["acme", "globex"][n % 2], &format!("b-{n}"))).await });
    }
    for written in both.join_all().await {
        assert!(written.is_ok(), "a write in a batch of two tenants failed: {written:?}");
    }
    assert!(commits.remember(message("acme", "m-last")).await.is_ok());

    // The database drops the kept connection (as a restart would): the next write still lands.
    // (A role may end its own backends; the owner may not end the API role's.)
    let mut own = <sqlx::PgConnection as sqlx::Connection>::connect(&db.app_url).await.expect("connect");
    let dropped: i64 = sqlx::query_scalar(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
         WHERE datname = current_database() AND usename = current_user AND pid <> pg_backend_pid()",
    )
    .fetch_one(&mut own)
    .await
    .expect("terminate");
    assert!(dropped >= 1, "the committer's connection was not found");
    let written = commits.remember(message("globex", "after-drop")).await;
    assert!(written.is_ok(), "the first write after the connection dropped: {written:?}");
    assert_eq!(db.count("SELECT count(*) FROM memory_items").await, 14);
}
