package orders

import (
	"context"
	"errors"
	"net/http"

	"github.com/idemkit/idem"
)

// ChargeStep is the name of the step that charges an order (idem.Step): what
// idem inspect shows and idem resolve --step settles.
const ChargeStep = "charge"

// chargeResult is the charge step's recorded result: {"id": "ch_…"}, the
// provider's charge, as an operator settles it (idem resolve --step charge
// --done '{"id":"ch_…"}').
type chargeResult struct {
	ID string `json:"id"`
}

// errChargeUnknown is the error of a charge this attempt sent and got no
// answer to, when Payments.RefuseUnknown keeps it from being run again.
var errChargeUnknown = errors.New("orders: the charge's outcome is unknown")

// charge charges the order's total at the provider as the step "charge" of
// the request's operation and returns the charge id. The step's derived key
// is the call's Idempotency-Key, so every attempt of one order sends the same
// key; a charge recorded by an earlier attempt is returned without a call.
func (s *Service) charge(ctx context.Context, cartID string, total int64) (string, error) {
	p := s.cfg.Payments
	if _, _, keyed := idem.KeyFrom(ctx); !keyed {
		// A request without an Idempotency-Key (idem demo --require-key=false)
		// is unprotected: one attempt, one charge, with a key of its own.
		return p.Charge(ctx, "ord_"+newID()[4:], cartID, total)
	}
	policy := idem.StepRerun
	if p.RefuseUnknown {
		policy = idem.StepRefuse
	}
	res, err := idem.Step(ctx, ChargeStep, func(ctx context.Context, key string) (chargeResult, error) {
		id, err := p.Charge(ctx, key, cartID, total)
		var declined *DeclinedError
		var perr *ProviderError
		switch {
		case errors.As(err, &declined):
			return chargeResult{}, idem.StepFinal(err) // recorded: the retry hears the same decline
		case errors.As(err, &perr) && perr.mayHaveCharged():
			// Sent, and no answer (a timeout, a dropped connection), or a
			// success answer that cannot be read: the provider may have
			// charged. The step stays begun, as after a
			// crash: the next attempt asks again with the same key, or
			// refuses (RefuseUnknown).
			return chargeResult{}, idem.StepAmbiguous(err)
		case err != nil:
			return chargeResult{}, err // transient: the next attempt asks again, same key
		}
		return chargeResult{ID: id}, nil
	}, idem.OnUnknown(policy))
	var perr *ProviderError
	if p.RefuseUnknown && errors.As(err, &perr) && perr.mayHaveCharged() {
		// This attempt does not know either: the outcome is unknown now.
		idem.MarkOutcomeUnknown(ctx)
		return "", errors.Join(errChargeUnknown, err)
	}
	if err == nil && (res.ID == "" || checkText("the charge id", res.ID, MaxChargeID) != "") {
		// A step settled by hand with a result that is no charge.
		return "", errors.New("the recorded charge " + Quote(res.ID) + ` is not a charge id; settle the step "charge" with --done '{"id":"ch_…"}'`)
	}
	return res.ID, err
}

// writeChargeError answers a charge that did not give a charge id.
func (s *Service) writeChargeError(w http.ResponseWriter, ctx context.Context, err error) {
	var failed *idem.StepFailedError
	var provider *ProviderError
	var declined *DeclinedError
	switch {
	case !errors.As(err, &failed) && errors.As(err, &declined):
		// An unkeyed request's charge, not a step: nothing is stored.
		WriteProblem(w, http.StatusPaymentRequired, "payment_failed", "the payment failed and no order was created: "+declined.Error())
	case errors.As(err, &failed):
		// Final: written by the handler, so stored and replayed. On the
		// attempt that was declined the error wraps the provider's answer; a
		// later one has the recorded message.
		msg := failed.Message
		if errors.As(err, &declined) {
			msg = declined.Error()
		}
		WriteProblem(w, http.StatusPaymentRequired, "payment_failed", "the payment failed and no order was created: "+msg+"; a retry with this Idempotency-Key gets this answer again, use a new key to try another payment")
	case errors.Is(err, idem.ErrStepUnknown), errors.Is(err, errChargeUnknown):
		WriteProblem(w, http.StatusBadGateway, "payment_unknown", "the order was not created: an attempt with this Idempotency-Key began charging it and its outcome was never recorded (the provider may have charged), and this service does not charge again without knowing (--payment-unknown refuse); an operator settles it with idem resolve --step charge, until then every retry gets this answer ("+err.Error()+")")
	case errors.Is(err, idem.ErrStepNotRecorded):
		WriteProblem(w, http.StatusInternalServerError, "order_not_saved", "the order was not created: the charge ran but could not be recorded ("+err.Error()+"); retry with the same Idempotency-Key: the provider is asked again with the same key")
	case ctx.Err() != nil:
		WriteProblem(w, http.StatusServiceUnavailable, "request_cancelled", "the order was not created because the request was cancelled ("+context.Cause(ctx).Error()+"); retry with the same Idempotency-Key")
	case errors.As(err, &provider):
		WriteProblem(w, http.StatusBadGateway, "payment_unavailable", "the order was not created: "+provider.Error()+"; retry with the same Idempotency-Key: the provider is asked again with the same key, so it cannot charge twice")
	default:
		WriteProblem(w, http.StatusInternalServerError, "order_not_saved", "the order could not be saved: "+err.Error()+"; retry with the same Idempotency-Key")
	}
}

// mayHaveCharged reports whether the provider may have charged although the
// charge failed: the request was sent and no answer came (a timeout, a
// connection cut), or a success answer came that could not be read (a body
// that is no charge, cut short). Such a step's outcome is unknown, not a
// transient failure that every policy runs again.
func (e *ProviderError) mayHaveCharged() bool {
	return e.Sent && (e.Status == 0 || e.Status >= 200 && e.Status < 300)
}
