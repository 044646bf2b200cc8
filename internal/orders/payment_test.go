package orders_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/orders"
	"github.com/idemkit/idem/internal/orders/fakepay"
)

// TestPaymentsCharge: what each answer of a provider is to Payments.Charge: a
// charge, a decline (final), or a provider error (transient), and whether
// the request may have reached the provider.
func TestPaymentsCharge(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	p := fakepay.Start(fakepay.HonoursKeys)
	t.Cleanup(p.Close)
	pay := &orders.Payments{URL: p.URL + "/", Timeout: 300 * time.Millisecond}

	id, err := pay.Charge(ctx, "k1", "c_1", 1900)
	if err != nil || id == "" || p.Charges()[0].ID != id || p.Charges()[0].Key != "k1" || p.Charges()[0].AmountCents != 1900 {
		t.Fatalf("Charge: %q %v; provider has %+v", id, err, p.Charges())
	}
	if again, err := pay.Charge(ctx, "k1", "c_1", 1900); err != nil || again != id {
		t.Fatalf("same key again: %q %v, want the replayed %q", again, err, id)
	}
	// The same key with another body: the provider's 422 is final.
	var declined *orders.DeclinedError
	if _, err := pay.Charge(ctx, "k1", "c_1", 1); !errors.As(err, &declined) || declined.Status != 422 {
		t.Fatalf("same key, other amount: %v, want a 422 decline", err)
	}
	var perr *orders.ProviderError
	for _, status := range []int{402, 400, 404} {
		p.FailNext(status)
		if _, err := pay.Charge(ctx, "k-"+http.StatusText(status), "c_2", 5); !errors.As(err, &declined) || declined.Status != status || declined.Message == "" {
			t.Errorf("provider %d: %v, want a decline with its message", status, err)
		}
	}
	for _, status := range []int{408, 409, 425, 429, 500, 503} {
		p.FailNext(status)
		if _, err := pay.Charge(ctx, "k-t"+http.StatusText(status), "c_3", 5); !errors.As(err, &perr) || perr.Status != status || !perr.Sent {
			t.Errorf("provider %d: %v, want a transient provider error, sent", status, err)
		}
	}
	p.SetDelay(2 * time.Second)
	if _, err := pay.Charge(ctx, "k-slow", "c_4", 5); !errors.As(err, &perr) || perr.Status != 0 || !perr.Sent {
		t.Errorf("a provider slower than the timeout: %v, want an unanswered provider error, sent", err)
	}
	p.SetDelay(0)
	down := &orders.Payments{URL: "http://127.0.0.1:9"}
	if _, err := down.Charge(ctx, "k", "c", 1); !errors.As(err, &perr) || perr.Sent {
		t.Errorf("unreachable: %v, want a provider error, not sent", err)
	}
	odd := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(201)
		_, _ = w.Write([]byte(`{"status":"ok"}`))
	}))
	t.Cleanup(odd.Close)
	if _, err := (&orders.Payments{URL: odd.URL}).Charge(ctx, "k", "c", 1); !errors.As(err, &perr) || perr.Status != 201 {
		t.Errorf("a 201 without an id: %v, want a provider error", err)
	}
}
