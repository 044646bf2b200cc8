package pgstore_test

import (
	"bytes"
	"context"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/racetest"
)

// TestOrdersRace fires 100 requests with one key at a real HTTP server, released
// together, and counts the orders in the database: exactly one.
func TestOrdersRace(t *testing.T) {
	t.Parallel()
	for _, fl := range flows {
		t.Run(fl.name, func(t *testing.T) {
			t.Parallel()
			const n = 100
			db := newTestDB(t, 10)
			app := newOrderApp(t, db)
			slow := func(context.Context) { time.Sleep(100 * time.Millisecond) } // keep the key busy while the others arrive
			srv := httptest.NewServer(app.serve(t, &idem.Config{Flow: fl.flow}, app.handler("race", slow)))
			defer srv.Close()
			key := "race-" + randomHex(8)
			body := []byte(`{"item":"book","qty":1}`)

			results := racetest.Fire(n, racetest.Post(srv.URL+"/orders", key, body, nil))

			var executed, replayed, inFlight int
			var first *racetest.Result
			for i := range results {
				r := &results[i]
				if r.Err != nil {
					t.Fatalf("request %d: %v", i, r.Err)
				}
				switch {
				case r.Status == 201 && r.Header.Get(idem.ReplayedHeader) == "":
					executed++
					first = r
				case r.Status == 201 && r.Header.Get(idem.ReplayedHeader) == "true":
					replayed++
				case r.Status == 409 && problemCode(r.Body) == idem.CodeKeyInUse:
					inFlight++
				default:
					t.Errorf("request %d: status %d, body %s; want 201, a replayed 201 or a 409 in-use problem", i, r.Status, r.Body)
				}
			}
			t.Logf("%s: %d executed, %d replayed, %d answered 409", fl.name, executed, replayed, inFlight)
			if executed != 1 {
				t.Fatalf("%d requests executed the handler, want exactly 1", executed)
			}
			for i, r := range results {
				if r.Status == 201 && r.Header.Get(idem.ReplayedHeader) == "true" {
					if !bytes.Equal(r.Body, first.Body) || r.Header.Get("Location") != first.Header.Get("Location") {
						t.Errorf("replay %d = %q (Location %q), want the original %q (Location %q)", i, r.Body, r.Header.Get("Location"), first.Body, first.Header.Get("Location"))
					}
				}
			}
			if got := app.ordersFor(t, key, ""); got != 1 {
				t.Fatalf("%d orders in the database for key %s, want exactly 1", got, key)
			}
			// A later retry replays the same bytes.
			again := post(srv.URL+"/orders", key, body)
			if again.err != nil || again.status != 201 || !again.replayed || !bytes.Equal(again.body, first.Body) {
				t.Fatalf("retry after the race = %d replayed=%v %q (err %v), want a replay of %q", again.status, again.replayed, again.body, again.err, first.Body)
			}
			rec, err := app.store.Get(context.Background(), "", key, time.Now())
			if err != nil || rec.State != idem.StateComplete {
				t.Fatalf("record after the race = %+v, %v; want complete", rec, err)
			}
		})
	}
}
