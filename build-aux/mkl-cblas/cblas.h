/* oneMKL names its CBLAS header mkl_cblas.h; the chapters include <cblas.h> (configure
   --with-blas=mkl puts this folder on the include path; chapter blas).  Its enumeration of the
   storage order is CBLAS_LAYOUT, of which CBLAS_ORDER, the name of the reference CBLAS, OpenBLAS
   and BLIS, is only a typedef: the chapters write enum CBLAS_ORDER. */
#include <mkl_cblas.h>
#define CBLAS_ORDER CBLAS_LAYOUT
