package orders

import (
	"context"
	"errors"
	"net/http"
)

// charge charges the order's total at the provider and returns the charge id.
func (s *Service) charge(ctx context.Context, cartID string, total int64) (string, error) {
	return s.cfg.Payments.Charge(ctx, "ord_"+newID()[4:], cartID, total)
}

// writeChargeError answers a charge that did not give a charge id.
func (s *Service) writeChargeError(w http.ResponseWriter, ctx context.Context, err error) {
	var declined *DeclinedError
	var provider *ProviderError
	switch {
	case errors.As(err, &declined):
		// Final: written by the handler, so stored and replayed.
		WriteProblem(w, http.StatusPaymentRequired, "payment_failed", "the payment failed and no order was created: "+declined.Error()+"; a retry with this Idempotency-Key gets this answer again, use a new key to try another payment")
	case ctx.Err() != nil:
		WriteProblem(w, http.StatusServiceUnavailable, "request_cancelled", "the order was not created because the request was cancelled ("+context.Cause(ctx).Error()+"); retry with the same Idempotency-Key")
	case errors.As(err, &provider):
		WriteProblem(w, http.StatusBadGateway, "payment_unavailable", "the order was not created: "+provider.Error()+"; retry with the same Idempotency-Key: the provider is asked again with the same key, so it cannot charge twice")
	default:
		WriteProblem(w, http.StatusInternalServerError, "order_not_saved", "the order could not be saved: "+err.Error()+"; retry with the same Idempotency-Key")
	}
}
