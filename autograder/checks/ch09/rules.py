"""Chapter 09's rule tables: every requirement of each task's text, the check that enforces it, the kept
wrong answer it rejects."""

from __future__ import annotations

from autograder.rules import Rule

RULES: dict[str, list[Rule]] = {
    "keyset_page": [
        Rule(
            "Rows that share one `created_at` are never skipped or repeated at a page boundary",
            "check_keyset_page: 23 rows in ties of 3 read 5 at a time on a quiet table; rows missing or twice "
            "around a boundary inside a tie are named",
            "no_tie_breaker",
        ),
        Rule(
            "A page never starts with the last row of the page before",
            "check_keyset_page: the quiet walk; a repeated row that ended the page before is reported as a "
            "non-strict comparison",
            "lte_repeats",
        ),
        Rule(
            "`next_cursor` is `None` when no row follows the last one returned",
            "check_keyset_page: exactly 20 rows at limit 5 must take four calls; a fifth, empty page is reported",
            "no_limit_plus_one",
        ),
        Rule(
            "Pages never skip or repeat a row while other sessions insert and delete rows between two calls",
            "check_keyset_page: between pages the check inserts newer rows and deletes rows already read; "
            "repeats and skips against the rows that existed throughout are reported",
            "offset_pages",
        ),
        Rule(
            "The cursor still works after the row it was made from is deleted",
            "check_keyset_page: the row that ended page 3 is deleted before page 4 is read; an empty or short "
            "page 4 is reported",
            "id_only_cursor",
        ),
        Rule(
            "a row deleted before its page is read is not returned",
            "check_keyset_page: two rows not yet read are deleted; returning them is reported",
            "materialised_snapshot",
        ),
        Rule(
            "a cursor that was altered in any way, or is not one of yours, raises `InvalidCursor`",
            "check_keyset_page: sixteen one-character changes of a real cursor and two strings that are not cursors "
            "must each raise InvalidCursor (or, where the change left the decoded bytes alone, return page 2 unchanged)",
            "unsigned_cursor",
        ),
        Rule(
            "any replica of the service reads the cursors that another replica made",
            "check_keyset_page: pages alternate between two replicas of the answer cell",
            "per_process_secret",
        ),
        Rule(
            "Many rows share one `created_at`, and ids are not in time order",
            "check_keyset_page: 23 rows in ties of 3 with shuffled ids read 5 at a time; rows missing or twice around a tie are named",
            wrong="no_tie_breaker",
        ),
        Rule(
            "rows is a list of at most limit tuples",
            "check_keyset_page: exactly 20 rows at limit 5 must take four pages of at most 5 rows and no fifth, empty page",
            wrong="no_limit_plus_one",
        ),
        Rule(
            "`created_at` has microseconds, and rows a fraction of a second apart are common",
            "check_keyset_page: the rows' created_at values are 0.250001 s apart (ties in one second); a cursor "
            "without the microseconds lands inside its own second and repeats or skips rows",
            "cursor_drops_microseconds",
        ),
        Rule(
            "an answer that calls the chapter's own",
            "check_keyset_page: the answer cell's source is parsed; a call of course.pagination.fetch_page or "
            "ch09's posts_page is named and scores zero",
            wrong="calls_fetch_page",
        ),
        Rule(
            "Putting a version number in the cursor is good practice; it is not graded",
            "check_keyset_page: not checked (the text says it is not graded)",
            not_graded=True,
        ),
    ],
    "hash_ring": [
        Rule(
            "When an eleventh node joins ten, only about 1/11 of the keys move",
            "check_hash_ring: 10,000 keys, 10 -> 11 nodes; moved share must lie in [4.5 %, 16 %]",
            "modulo",
        ),
        Rule(
            "every key that moves, moves to the new node",
            "check_hash_ring: keys that moved between old nodes are counted",
            "rebuilt_sorted_by_index",
        ),
        Rule(
            "Each of ten nodes gets within 65 % of the mean share of keys",
            "check_hash_ring: 10,000 keys over 10 nodes; the worst node's distance from the mean is reported",
            "one_point_per_node",
        ),
        Rule(
            "Placement depends only on the node names and the key, not on the order nodes were added in",
            "check_hash_ring: rings built in opposite orders must agree on every key",
            "order_dependent",
        ),
        Rule(
            "Two processes of the service, started separately, place every key on the same node",
            "check_hash_ring: two fresh Python processes with PYTHONHASHSEED=1 and =2 must agree",
            "python_hash",
        ),
        Rule(
            "Removing a node moves only the keys that were on it",
            "check_hash_ring: node-3 removed from 11 nodes; keys of other nodes that moved are counted",
            "remove_reshuffles",
        ),
        Rule(
            "a consistent-hash ring with virtual nodes",
            "check_hash_ring: HashRing() with add_node/node_for; 10,000 keys over 10 nodes must lie within 65 % of the mean",
            wrong="one_point_per_node",
        ),
        Rule(
            "the node that owns key",
            "check_hash_ring: node_for must return one of the ring's nodes, the same one when asked again, and keep keys when nodes join",
            wrong="modulo",
        ),
        Rule(
            "Python's built-in hash() of a string is different in every process",
            "check_hash_ring: two fresh Python processes with PYTHONHASHSEED=1 and =2 must agree",
            wrong="python_hash",
        ),
    ],
}

REFERENCES: dict[str, list[str]] = {
    "keyset_page": ["course.chapters.ch09.pages:posts_page", "course.pagination:fetch_page"],
    "hash_ring": ["course.sharding:HashRing"],
}
