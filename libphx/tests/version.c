/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Description: phx_version() is the header's MAJOR.MINOR.PATCH, and
 * phx_strerror_last() is never NULL, even before any error.
 */
#include "helpers.h"

int main(void)
{
	char want[64];

	snprintf(want, sizeof(want), "%d.%d.%d", PHX_VERSION_MAJOR, PHX_VERSION_MINOR,
		 PHX_VERSION_PATCH);
	T_CHECK(phx_version() != NULL, "NULL version");
	T_CHECK(strcmp(phx_version(), want) == 0, "version %s, header %s", phx_version(), want);
	T_CHECK(phx_strerror_last() != NULL, "strerror_last NULL");
	return T_EXIT_PASS;
}
