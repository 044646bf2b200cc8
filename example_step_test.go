package idem_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
)

// paymentProvider stands for a payment API: it charges once per call, and
// the charge's id shows the Idempotency-Key it was sent with.
type paymentProvider struct {
	mu    sync.Mutex
	calls int
}

// Charge is what the provider answers.
type Charge struct {
	ID          string `json:"id"`
	AmountCents int    `json:"amount_cents"`
}

var errCardDeclined = errors.New("card declined")

func (p *paymentProvider) charge(ctx context.Context, idempotencyKey string, cents int) (Charge, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls++
	if cents > 100_000 {
		return Charge{}, errCardDeclined
	}
	return Charge{ID: "ch_" + idempotencyKey[5:13], AmountCents: cents}, nil
}

// A handler that charges a card at another service before it stores the
// order: the charge is a step, so that a retry after a crash between the
// charge and the commit gets the recorded charge instead of charging again.
func ExampleStep() {
	store := memstore.New(nil)
	defer store.Close()
	protect, err := idem.New(store, nil)
	if err != nil {
		log.Fatal(err)
	}
	provider := &paymentProvider{}
	crashOnce := true
	orders := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ch, err := idem.Step(r.Context(), "charge", func(ctx context.Context, key string) (Charge, error) {
			c, err := provider.charge(ctx, key, 1250) // key: the step's derived Idempotency-Key
			if errors.Is(err, errCardDeclined) {
				return c, idem.StepFinal(err) // recorded: a retry hears the same decline
			}
			return c, err // any other error is transient: the retry charges again, with the same key
		})
		switch {
		case errors.Is(err, idem.ErrStepFailed):
			http.Error(w, err.Error(), http.StatusPaymentRequired)
			return
		case err != nil:
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		if crashOnce { // the process dies after the charge, before the order is stored
			crashOnce = false
			panic(http.ErrAbortHandler)
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"order":"o_1","charge_id":%q}`, ch.ID)
	})
	srv := httptest.NewServer(protect(orders))
	defer srv.Close()

	for range 3 { // the client retries until it has an answer, then once more
		req, _ := http.NewRequest("POST", srv.URL+"/orders", strings.NewReader(`{"cart_id":"c_42"}`))
		req.Header.Set("Idempotency-Key", "8e03978e-40d5-43e8-bc93-6894a57f9324")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			fmt.Println("no answer: the server crashed")
			continue
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		fmt.Println(resp.StatusCode, strings.HasPrefix(string(body), `{"order":"o_1","charge_id":"ch_`), "replayed:", resp.Header.Get("Idempotent-Replayed") == "true")
	}
	fmt.Println("charges at the provider:", provider.calls)
	// Output:
	// no answer: the server crashed
	// 201 true replayed: false
	// 201 true replayed: true
	// charges at the provider: 1
}
